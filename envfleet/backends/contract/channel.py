"""A worker's side of a connection to the pool: receive commands, serve them, reply.

Two loops, one per wire; results land in shared memory and the reply says only what the pool
cannot read there:

- :func:`serve_pipes` (the process backend): raw bytes over two pipes. A command is
  one byte :data:`REPEAT` (run the previous command again: the pool sends the same
  whole-group step every step) or :data:`FRAME`, a length and a pickle. A reply is one byte
  :data:`PLAIN` (done, nothing to report), a :data:`COLUMNS` frame (nothing but infos of plain
  scalars, as columns) or a frame. :class:`FrameReader` reads replies on the pool's side. A step
  that reports nothing costs one byte each way and no pickling.
- :func:`serve_connection` (the Ray backend's same-machine actors): a ``multiprocessing``
  connection over a Unix socket, one pickled message each way (a reply that carries nothing but
  infos of plain scalars: their columns alone).
"""

from __future__ import annotations

import functools
import os
import pickle
import secrets
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import (
    Connection,
    answer_challenge,
    deliver_challenge,
)
from multiprocessing.reduction import ForkingPickler
from typing import Any

from envfleet.errors import Phase
from envfleet.infos import Columns, column_dicts, info_columns
from envfleet.protocol import Close, Command, EnvFailure, Group, Reply
from envfleet.worker import serve


def plain(reply: Reply) -> bool:
    """Nothing to report beyond success: the pool knows which envs the command named, and
    their rows are where it reads them (such a reply travels as ``None``, or one byte)."""
    return not reply.infos and not _beyond_infos(reply)


def as_columns(reply: Reply) -> Columns | None:
    """The reply's infos as columns when it reports nothing else and they are all plain
    scalars (:func:`~envfleet.infos.info_columns`); ``None`` when it must travel whole."""
    if reply.infos and not _beyond_infos(reply):
        return info_columns(reply.infos)
    return None


def _beyond_infos(reply: Reply) -> bool:
    """Whether ``reply`` reports anything but infos: failures, restarts, rows, call results or
    rows left as they were (those always come with a restarted env's infos)."""
    return bool(reply.failures or reply.restarts or reply.rows or reply.values or reply.kept)


def spin(ready: Callable[[], bool], seconds: float) -> bool:
    """Poll ``ready()`` for up to ``seconds`` without sleeping; True once it says so."""
    if seconds <= 0:
        return False
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if ready():
            return True
    return False


def serve_connection(group: Group, conn: Connection, spin_seconds: float = 0.0) -> None:
    """Serve the pool's commands until it sends :class:`Close` or goes away (then close envs)."""
    while True:
        try:
            spin(conn.poll, spin_seconds)
            data = conn.recv_bytes()
        except (EOFError, OSError):
            group.close()
            return
        try:
            command: Command = pickle.loads(data)
        except Exception as exc:
            conn.send(undecodable(exc))
            continue
        reply = serve(group, command)
        message: Reply | Columns | None = None if plain(reply) else as_columns(reply) or reply
        try:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # an info or call result that cannot be pickled
                conn.send(Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),)))
        except (BrokenPipeError, ConnectionResetError):
            group.close()
            return
        if isinstance(command, Close):
            return


PLAIN = 0
"""Reply tag: the command is done and there is nothing to report (one byte on the wire)."""
REPEAT = 0
"""Command tag: run the previous command again (one byte on the wire)."""
FRAME = 1
"""Tag of a framed message: an 8-byte little-endian length, then that many bytes of pickle."""
COLUMNS = 2
"""Tag of a framed reply that carries nothing but infos as columns, with no pickle to read: a
length, then :data:`_COLUMNS_HEAD` (how many env ids the reply names, how many the columns name,
0 when the same ones, the layout's length), the env ids as 4-byte unsigned ints, the layout
and the records (:data:`~envfleet.infos.Columns`)."""
READ_SIZE = 1 << 16
"""Bytes :meth:`FrameReader.read` asks of a pipe at a time (a shorter read: it is empty)."""
_COLUMNS_HEAD = struct.Struct("<III")
_LENGTH = struct.Struct("<Q")
_HEADER = 1 + _LENGTH.size
_PLAIN_BYTES = bytes([PLAIN])
_FRAME_BYTES = bytes([FRAME])
_COLUMNS_TAG = bytes([COLUMNS])
REPEAT_BYTES = bytes([REPEAT])


def frame(body: bytes) -> bytes:
    """``body`` as a framed message."""
    return bytes([FRAME]) + _LENGTH.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the blocking descriptor ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes:
    """``n`` bytes from the blocking descriptor ``fd``; ``EOFError`` if it closes first."""
    data = os.read(fd, n)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        if not data:
            raise EOFError
        data = os.read(fd, n - got)
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def encode_reply(reply: Reply) -> bytes:
    """A reply on the wire: one byte when plain; a :data:`COLUMNS` frame when it carries only
    infos of plain scalars (:func:`~envfleet.infos.info_columns`); else a frame (an
    unpicklable one replaced by the failure that says so)."""
    if plain(reply):
        return _PLAIN_BYTES
    columns = as_columns(reply)
    if columns is not None:
        try:
            return _columns_frame(reply.env_ids, columns)
        except struct.error:  # an env id past 4 bytes: the reply goes pickled
            pass
    try:
        body = bytes(ForkingPickler.dumps(reply))
    except Exception as exc:  # an info or call result that cannot be pickled
        failed = Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),))
        body = bytes(ForkingPickler.dumps(failed))
    return frame(body)


@functools.lru_cache(maxsize=256)
def _ids_struct(count: int) -> struct.Struct:
    """``count`` env ids on the wire."""
    return struct.Struct(f"<{count}I")


def _columns_frame(env_ids: tuple[int, ...], columns: Columns) -> bytes:
    """A :data:`COLUMNS` frame: the reply's ``env_ids`` and its infos as ``columns``."""
    ids, blob, data = columns
    same = ids == env_ids
    named = env_ids if same else env_ids + ids
    head = _COLUMNS_HEAD.pack(len(env_ids), 0 if same else len(ids), len(blob))
    size = len(head) + 4 * len(named) + len(blob) + len(data)
    return b"".join(
        (_COLUMNS_TAG, _LENGTH.pack(size), head, _ids_struct(len(named)).pack(*named), blob, data)
    )


def _read_columns(
    body: bytes | bytearray | memoryview, at: int, end: int
) -> tuple[tuple[int, ...], Columns]:
    """The reply's env ids and its columns from the :data:`COLUMNS` frame body at
    ``body[at:end]``."""
    count, other, size = _COLUMNS_HEAD.unpack_from(body, at)
    at += _COLUMNS_HEAD.size
    named = _ids_struct(count + other).unpack_from(body, at)
    at += 4 * (count + other)
    env_ids = named[:count] if other else named
    ids = named[count:] if other else named
    return env_ids, (ids, bytes(body[at : at + size]), bytes(body[at + size : end]))


def serve_pipes(
    group: Group,
    command_fd: int,
    reply_fd: int,
    spin_seconds: float = 0.0,
    after: Callable[[], None] | None = None,
) -> None:
    """Serve the pool's commands read from ``command_fd`` until it sends :class:`Close` or goes
    away (EOF: then close the envs), writing each reply to ``reply_fd``; ``spin_seconds``: how
    long to poll for the next command before blocking in the kernel; ``after``: called after
    each command, before its reply goes (the spare rows' copy,
    :mod:`~envfleet.backends.contract.spares`).

    The loop a worker runs every step: a repeated command and a plain reply cost one
    ``read`` and one ``write`` of a byte, and nothing else but the command itself (issue 23).
    """
    command: Command | None = None
    ready = _readable(command_fd) if spin_seconds > 0 else None
    read, write = os.read, os.write
    while True:
        try:
            if ready is not None:
                spin(ready, spin_seconds)
            tag = read(command_fd, 1)
            if tag == _FRAME_BYTES:
                (size,) = _LENGTH.unpack(_read_exact(command_fd, _LENGTH.size))
                body = _read_exact(command_fd, size)
                try:
                    command = pickle.loads(body)
                except Exception as exc:
                    command = None  # nothing to repeat
                    write_all(reply_fd, encode_reply(undecodable(exc)))
                    continue
            elif not tag or command is None:
                raise EOFError  # the pool is gone; or a repeat with nothing to repeat
        except (EOFError, OSError):
            group.close()
            return
        reply = serve(group, command)
        if after is not None:
            after()
        try:
            if plain(reply):  # the hot path: one byte, written whole (a blocking pipe)
                write(reply_fd, _PLAIN_BYTES)
            else:
                write_all(reply_fd, encode_reply(reply))
        except OSError:  # the pool is gone
            group.close()
            return
        if isinstance(command, Close):
            return


def _readable(fd: int) -> Callable[[], bool]:
    """Whether ``fd`` has something to read, asked without blocking."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return lambda: bool(poller.poll(0))


class FrameReader:
    """The pool's side of one worker's reply pipe: bytes in, whole replies out.

    A reply larger than the pipe's buffer arrives in pieces; what is not yet a whole reply is
    kept for the next :meth:`feed`. Infos sent as columns go to ``infos`` (the pool's
    :class:`~envfleet.infos.InfoTable`), and their reply reads as plain; with no ``infos``,
    they come back as the reply's dicts.
    """

    def __init__(self, infos: Callable[[Columns], None] | None = None) -> None:
        self._buffer = bytearray()
        self._infos = infos
        # The last columns reply read whole: all of it but its records (which say the same env
        # ids and layout every step), its length, and what that part says. A reply that starts
        # with these very bytes and has this length says the same: only its records are new.
        self._known: tuple[bytes, int, tuple[int, ...], tuple[int, ...], bytes] | None = None

    @property
    def partial(self) -> bool:
        """Part of a reply has arrived, not all of it."""
        return bool(self._buffer)

    def read(self, fd: int, out: list[Reply | None]) -> bool:
        """Read what the non-blocking ``fd`` holds and :meth:`feed` it; False at EOF."""
        while True:
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if data == _PLAIN_BYTES and not self._buffer:  # the hot path: one plain reply
                out.append(None)
                return True
            if not data:
                return False
            self.feed(data, out)
            if len(data) < READ_SIZE:
                return True

    def feed(self, data: bytes, out: list[Reply | None]) -> None:
        """Take ``data`` in; append each reply it completes to ``out`` (``None``: plain)."""
        if not self._buffer:
            if data == _PLAIN_BYTES:  # the hot path
                out.append(None)
                return
            if data[0] == COLUMNS and len(data) > _HEADER:  # the hot path of Atari, MuJoCo
                known = self._known
                if known is not None and len(data) == known[1] and data.startswith(known[0]):
                    columns = (known[3], known[4], data[len(known[0]) :])
                    out.append(self._columns((known[2], columns)))
                    return
                (size,) = _LENGTH.unpack_from(data, 1)
                if len(data) == _HEADER + size:
                    env_ids, columns = _read_columns(data, _HEADER, len(data))
                    ids, blob, records = columns
                    start = len(data) - len(records)
                    self._known = (data[:start], len(data), env_ids, ids, blob)
                    out.append(self._columns((env_ids, columns)))
                    return
        buffer = self._buffer
        buffer += data
        pos, end = 0, len(buffer)
        header = _HEADER
        while pos < end:
            if buffer[pos] == PLAIN:
                out.append(None)
                pos += 1
                continue
            if end - pos < header:
                break
            (size,) = _LENGTH.unpack_from(buffer, pos + 1)
            if end - pos - header < size:
                break
            if buffer[pos] == COLUMNS:
                out.append(self._columns(_read_columns(buffer, pos + header, pos + header + size)))
            else:
                out.append(pickle.loads(bytes(buffer[pos + header : pos + header + size])))
            pos += header + size
        del buffer[:pos]

    def _columns(self, message: tuple[tuple[int, ...], Columns]) -> Reply | None:
        env_ids, columns = message
        if self._infos is not None:
            self._infos(columns)
            return None
        return Reply(env_ids=env_ids, infos=column_dicts(columns))


def unpicklable(reply: Reply, exc: Exception) -> EnvFailure:
    """The failure that replaces a reply that cannot be pickled (naming its first env)."""
    try:
        raise TypeError(f"the reply could not be pickled to send to the pool: {exc}") from exc
    except TypeError as error:
        env = reply.env_ids[0] if reply.env_ids else None
        return EnvFailure.capture(env, Phase.STEP, error)


def undecodable(exc: Exception) -> Reply:
    """The reply to a command this worker could not unpickle: it pickled in the pool, but
    something in it cannot be rebuilt here (a class this process cannot import, a
    ``__reduce__`` that fails). The command failed as a whole, and the worker serves on."""
    try:
        raise TypeError(
            "the worker could not unpickle the command the pool sent it: an argument pickled "
            "in the pool cannot be rebuilt in the worker (see the cause)"
        ) from exc
    except TypeError as error:
        return Reply(failures=(EnvFailure.capture(None, Phase.CALL, error),))


class PickledCommands:
    """Commands pickled once each: the pool sends the same step-every-env commands every step."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Command, bytes]] = {}

    def dumps(self, command: Command) -> bytes:
        cached = self._cache.get(id(command))
        if cached is None or cached[0] is not command:
            if len(self._cache) > 256:
                self._cache.clear()
            cached = (command, bytes(ForkingPickler.dumps(command)))
            self._cache[id(command)] = cached
        return cached[1]


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


__all__ = [
    "CHECKING",
    "COLUMNS",
    "CONNECT_TIMEOUT",
    "FRAME",
    "HANDSHAKE_TIMEOUT",
    "PLAIN",
    "READ_SIZE",
    "REPEAT",
    "REPEAT_BYTES",
    "FrameReader",
    "PickledCommands",
    "accept_pool",
    "as_columns",
    "authenticated",
    "connect_pool",
    "encode_reply",
    "frame",
    "handshake",
    "open_listener",
    "plain",
    "serve_connection",
    "serve_pipes",
    "spin",
    "undecodable",
    "unpicklable",
    "write_all",
]
