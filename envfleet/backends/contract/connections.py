"""Authenticated Unix-socket connections between the pool and a worker or node agent.

:func:`open_listener` makes a socket only this user can reach; :func:`accept_pool` takes the
first connection that proves it knows the key (strangers checked on threads of their own, each
within :data:`HANDSHAKE_TIMEOUT`), :func:`connect_pool` and :func:`authenticated` are the
connecting side, and :func:`handshake` is ``multiprocessing``'s challenge both ways within one
deadline.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

__all__ = [
    "CHECKING",
    "CONNECT_TIMEOUT",
    "HANDSHAKE_TIMEOUT",
    "accept_pool",
    "authenticated",
    "connect_pool",
    "handshake",
    "open_listener",
]


HANDSHAKE_TIMEOUT = 5.0
"""Seconds a connection may take to prove it knows the key before it is dropped (the whole
exchange: one deadline, however its bytes come)."""

CHECKING = 16
"""Connections :func:`accept_pool` checks at once (each on a thread of its own); more wait to
be accepted until one of those is done (within :data:`HANDSHAKE_TIMEOUT`)."""

CONNECT_TIMEOUT = 60.0
"""Seconds the pool waits for an actor to take its connection (the actor may be dropping a
stranger's first, each within ``HANDSHAKE_TIMEOUT``)."""


def _io_timeout(fd: int, seconds: float) -> None:
    """Bound each blocking read and write on socket ``fd`` (0: no bound)."""
    sock = socket.socket(fileno=fd)
    try:
        whole = int(seconds)
        value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    finally:
        sock.detach()


def open_listener(inside: str | None = None) -> tuple[socket.socket, str, str | None]:
    """A Unix socket only this user can reach: ``(server, address, directory)``.

    A filesystem socket in a directory of mode 0700, which the kernel keeps other users out of
    (an abstract socket is listed in ``/proc/net/unix`` and open to every user): in ``inside``
    (the pool's own such directory, which the pool removes when it closes, so that nothing is
    left behind even when this process is killed first), else in a new one, returned as
    ``directory`` for the caller to remove. Where neither can be had, an abstract socket,
    guarded by the key alone.
    """
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory: str | None = None
    try:
        try:
            if inside is not None:
                address = os.path.join(inside, f"w-{secrets.token_hex(6)}")
                try:
                    server.bind(address)
                except OSError:  # not ours to enter after all: a directory of our own
                    inside = None
            if inside is None:
                directory = tempfile.mkdtemp(prefix="envfleet-")
                address = os.path.join(directory, "s")
                server.bind(address)
        except OSError:
            if directory is not None:
                os.rmdir(directory)
                directory = None
            address = f"\0envfleet-{secrets.token_hex(12)}"
            server.bind(address)
        server.listen(8)
    except BaseException:
        server.close()
        raise
    return server, address, directory


class _Handshake:
    """``multiprocessing``'s side of a handshake on ``sock``, every read and write of it
    within one ``deadline`` (``time.monotonic``): what :func:`deliver_challenge` and
    :func:`answer_challenge` ask of a :class:`Connection`, framed as it frames, without
    blocking past the deadline however slowly the other side sends."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.poller = select.poll()

    def _wait(self, event: int) -> None:
        left = self.deadline - time.monotonic()
        self.poller.register(self.sock.fileno(), event)
        try:
            if left <= 0 or not self.poller.poll(max(1, int(left * 1000 + 0.999))):
                raise TimeoutError("the handshake took longer than its bound")
        finally:
            self.poller.unregister(self.sock.fileno())

    def send_bytes(self, buf: bytes) -> None:
        view = memoryview(struct.pack("!i", len(buf)) + bytes(buf))
        while view:
            self._wait(select.POLLOUT)
            try:
                view = view[self.sock.send(view, socket.MSG_DONTWAIT) :]
            except (BlockingIOError, InterruptedError):
                pass

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            self._wait(select.POLLIN)
            try:
                chunk = self.sock.recv(n - len(data), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            if not chunk:
                raise EOFError("the connection closed during the handshake")
            data += chunk
        return data

    def recv_bytes(self, maxlength: int) -> bytes:
        (size,) = struct.unpack("!i", self._read(4))
        if size < 0 or size > maxlength:
            raise OSError("bad message length")
        return self._read(size)


def handshake(sock: socket.socket, authkey: bytes, timeout: float, accepting: bool) -> None:
    """Prove to the other end of ``sock`` that we know ``authkey``, and have it prove it, as
    ``multiprocessing``'s listeners and clients do (the accepting side challenges first), all
    within ``timeout`` seconds.

    Raises:
        AuthenticationError: a wrong key (either side's).
        TimeoutError: the exchange took longer than ``timeout``.
        EOFError, OSError: the connection closed, or a message was not the handshake's.
    """
    timed: Any = _Handshake(sock, time.monotonic() + timeout)
    if accepting:
        deliver_challenge(timed, authkey)
        answer_challenge(timed, authkey)
    else:
        answer_challenge(timed, authkey)
        deliver_challenge(timed, authkey)


def accept_pool(server: socket.socket, authkey: bytes) -> Connection:
    """The first connection that proves it has ``authkey``.

    Each connection is checked on a thread of its own (up to :data:`CHECKING` at once), the
    whole exchange within :data:`HANDSHAKE_TIMEOUT`, while the next ones are accepted: a
    stranger that connects first, however slowly it answers, neither keeps the pool's own
    connection waiting nor holds a thread past that bound. Those still being checked when
    one has proved it are dropped.
    """
    lock = threading.Lock()
    checking: set[socket.socket] = set()
    proved: list[socket.socket] = []
    settled = False
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)

    def check(sock: socket.socket) -> None:
        try:
            handshake(sock, authkey, HANDSHAKE_TIMEOUT, accepting=True)
            ok = True
        except Exception:  # a wrong key, a bad message, silence, a closed connection
            ok = False
        with lock:
            checking.discard(sock)
            if ok and not settled:
                proved.append(sock)
            else:
                sock.close()
            if not settled:
                try:
                    wake_w.send(b"!")
                except OSError:  # full: the acceptor has been woken already
                    pass

    blocking = server.gettimeout()
    server.setblocking(False)
    poller = select.poll()
    poller.register(wake_r.fileno(), select.POLLIN)
    listening = False
    try:
        while True:
            with lock:
                if proved:
                    settled = True
                    return Connection(proved.pop(0).detach())
                full = len(checking) >= CHECKING
            if listening == full:  # accept while there is room to check what comes in
                if full:
                    poller.unregister(server.fileno())
                else:
                    poller.register(server.fileno(), select.POLLIN)
                listening = not full
            for fd, _ in poller.poll():
                if fd == wake_r.fileno():
                    wake_r.recv(4096)
                    continue
                try:
                    sock, _ = server.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                sock.setblocking(True)
                with lock:
                    checking.add(sock)
                try:
                    threading.Thread(
                        target=check, args=(sock,), name="envfleet-handshake", daemon=True
                    ).start()
                except BaseException:
                    with lock:
                        checking.discard(sock)
                    sock.close()
                    raise
    finally:
        with lock:
            settled = True
            for sock in checking:  # their threads see the end at once, and close them
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            for sock in proved:
                sock.close()
            proved.clear()
        wake_r.close()
        wake_w.close()
        server.settimeout(blocking)


def connect_pool(address: str, authkey: bytes, timeout: float = CONNECT_TIMEOUT) -> Connection:
    """Connect to an actor's :func:`accept_pool`; ``OSError`` or ``AuthenticationError`` once
    nothing answered within ``timeout`` (the handshake included)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return authenticated(sock, authkey, timeout)


def authenticated(sock: socket.socket, authkey: bytes, timeout: float) -> Connection:
    """``sock``, connected, as a :class:`Connection` once both sides proved they know
    ``authkey`` (the connecting side's half of the handshake, bounded by ``timeout``); closed
    on any failure."""
    try:
        sock.settimeout(None)
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        _io_timeout(conn.fileno(), timeout)
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        _io_timeout(conn.fileno(), 0.0)
    except BaseException:
        conn.close()
        raise
    return conn
