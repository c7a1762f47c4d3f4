"""Messages on a pool-agent connection: whole ones in, in as few reads as the bytes allow; out
in one write, from their parts.

Both ends of the connection between a pool and a node agent write ``multiprocessing``'s frames
(:meth:`~multiprocessing.connection.Connection.send_bytes`: a 4-byte big-endian length, then
the message; ``-1`` and an 8-byte length past 2 GiB). Its ``recv_bytes`` reads a frame in two
reads at least (the length, then the message), through a ``BytesIO``, and its ``poll`` builds a
selector at each call. :class:`Frames` reads what the socket holds, up to :data:`CHUNK`, in one
read: a round's message, or a node's answer of small rows, is one system call, and what came
after it is kept for the next :meth:`Frames.read` (so a message can be whole here while the
socket has nothing more to read: ask :meth:`Frames.whole` before waiting on the socket);
:meth:`Frames.read_into` reads a message straight into buffers the reader gives (a rollout's
arrays: :mod:`~envfleet.backends.contract.raw_parts`).
:func:`send` writes a message the same way, its length and its parts (a node's rows: views of
its batch) in one ``writev``, where ``send_bytes`` takes one ``bytes`` (the parts joined) and
copies it again behind its length. Given a socket and a bound, it never blocks: what the peer
has no room for is written as room comes, and a peer that takes no byte of it within the bound
(stopped, or its machine unreachable) ends the send with :class:`SendTimeout`; meanwhile what
the peer sends is read (``waiting``), so two ends writing large messages to each other cannot
both block.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from envfleet.backends.contract.landing import Landing

Buffer = Any
"""A writable bytes-like object, contiguous (a flat ``uint8`` array, a ``bytearray``)."""

CHUNK = 1 << 16
"""Bytes asked for at each read of a message's start (a larger message's rest is read into a
buffer of its size)."""

Message = bytes | bytearray
"""A message as :meth:`Frames.read` returns it: a large one is the buffer it was read into."""

SEND_TIMEOUT = 60.0
"""Seconds a pool waits for a node agent to take any byte of a command it is sending when the
pool has no ``step_timeout``: a live agent reads its connection at least once a second, even
while its workers step."""


_SIZE = struct.Struct("!i")
_LARGE = struct.Struct("!Q")


class Frames:
    """The messages that arrive on one connection's descriptor ``fd`` (blocking), whole."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""  # read, not yet a whole message's: what follows the last one read
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def whole(self) -> bool:
        """A whole message has been read and waits here (the socket may have nothing more)."""
        size, start = _frame(self._buffer)
        return size >= 0 and len(self._buffer) >= start + size

    def ready(self) -> bool:
        """:meth:`read` returns at once (a message waits here, or the socket has bytes: the
        rest of a message that has begun may still take a while)."""
        return self.whole() or bool(self._poller.poll(0))

    def read(self) -> Message:
        """The next message, waiting for it; ``EOFError`` when the connection has closed."""
        buffer = self._buffer
        while True:
            size, start = _frame(buffer)
            if size >= 0:
                end = start + size
                if len(buffer) >= end:
                    self._buffer = buffer[end:]
                    return buffer[start:end]
                if end - len(buffer) > CHUNK:  # a large message: its rest straight into place
                    self._buffer = b""
                    return self._read_into(buffer[start:], size)
            data = os.read(self.fd, CHUNK)
            if not data:
                self._buffer = b""
                raise EOFError("the connection closed" + (" mid-message" if buffer else ""))
            buffer = buffer + data if buffer else data

    def read_into(self, buffers: Sequence[Buffer]) -> None:
        """Read the next message straight into ``buffers``, one after the other (their sizes
        sum to its length): what was read ahead of it first, the rest from the socket.

        Raises:
            EOFError: the connection closed.
            OSError: the message is not as long as ``buffers`` (the peer does not speak
                this protocol: the connection is of no more use).
        """
        buffer = self._buffer
        size, start = _frame(buffer)
        while size < 0:
            data = os.read(self.fd, CHUNK)
            if not data:
                self._buffer = b""
                raise EOFError("the connection closed" + (" mid-message" if buffer else ""))
            buffer = buffer + data if buffer else data
            size, start = _frame(buffer)
        views = [memoryview(b).cast("B") for b in buffers]
        if size != sum(v.nbytes for v in views):
            self._buffer = b""
            raise OSError(
                f"a message of {size} bytes where {sum(v.nbytes for v in views)} were due"
            )
        end = min(len(buffer), start + size)
        landing = Landing(None, views, size)
        landing.fill(memoryview(buffer)[start:end])  # what was read of it already
        self._buffer = buffer[start + size :] if len(buffer) > start + size else b""
        while not landing.done:
            n = os.readv(self.fd, landing.iovecs())
            if n == 0:
                raise EOFError("the connection closed mid-message")
            landing.advance(n)

    def _read_into(self, head: bytes, size: int) -> bytearray:
        """A message of ``size`` bytes whose first bytes, ``head``, are in."""
        message = bytearray(size)
        view = memoryview(message)
        view[: len(head)] = head
        got = len(head)
        while got < size:
            n = os.readv(self.fd, [view[got:]])
            if n == 0:
                raise EOFError("the connection closed mid-message")
            got += n
        return message


class SendTimeout(TimeoutError):
    """The peer took no byte of a message within the bound (it is stopped, or unreachable)."""


def send(
    fd: int,
    parts: Sequence[bytes | memoryview],
    timeout: float | None = None,
    sock: socket.socket | None = None,
    waiting: Callable[[], None] | None = None,
) -> int:
    """Write one message, ``parts`` one after the other, to the connection's descriptor ``fd``,
    framed as ``Connection.send_bytes`` frames it; return its length.

    Blocking, unless ``timeout`` is given with ``sock`` (the connection, as a socket; its
    descriptor may be a duplicate of ``fd``): then written without blocking, as the peer makes
    room, and ``waiting()`` is called whenever the peer has sent something meanwhile (to read
    it: the peer may be blocked writing to us).

    Raises:
        SendTimeout: the peer took no byte for ``timeout`` seconds (the message is then cut
            short: the connection is of no more use).
        OSError: the connection broke.
    """
    size = sum([len(part) for part in parts])  # each a bytes-like of single bytes
    header = _SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LARGE.pack(size)
    chunks = [header, *parts]
    if timeout is not None and sock is not None:
        _send_within(sock, chunks, len(header) + size, timeout, waiting)
        return size
    sent = os.writev(fd, chunks)
    if sent < len(header) + size:  # a blocking socket writes all of it, unless a signal came
        rest = memoryview(b"".join(chunks))[sent:]
        while rest:
            rest = rest[os.write(fd, rest) :]
    return size


def _send_within(
    sock: socket.socket,
    chunks: list[bytes | memoryview],
    total: int,
    timeout: float,
    waiting: Callable[[], None] | None,
) -> None:
    """Write ``chunks`` (``total`` bytes) to ``sock`` without blocking: see :func:`send`."""
    sent = 0
    pending: list[bytes | memoryview] = chunks
    poller: select.poll | None = None
    deadline = 0.0
    while True:
        try:
            n = sock.sendmsg(pending, (), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        sent += n
        if sent >= total:
            return
        if n:
            pending = _after(pending, n)
        now = time.monotonic()
        if n or poller is None:  # progress: a new bound for the next byte
            deadline = now + timeout
        if poller is None:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT | (select.POLLIN if waiting else 0))
        left = deadline - now
        if left <= 0:
            raise SendTimeout(
                f"the peer took none of the last {total - sent} of {total} bytes within "
                f"{timeout:g}s"
            )
        for _, events in poller.poll(max(1, int(left * 1000 + 0.999))):
            if events & select.POLLIN and waiting is not None:
                waiting()


def _after(chunks: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """``chunks`` without their first ``n`` bytes."""
    for k, chunk in enumerate(chunks):
        if n < len(chunk):
            return [memoryview(chunk)[n:], *chunks[k + 1 :]]
        n -= len(chunk)
    return []


def _frame(buffer: bytes) -> tuple[int, int]:
    """The length of the message that starts ``buffer`` and where it starts (``-1``: its
    length is not all in yet)."""
    if len(buffer) < _SIZE.size:
        return -1, 0
    (size,) = _SIZE.unpack_from(buffer)
    if size != -1:
        return size, _SIZE.size
    if len(buffer) < _SIZE.size + _LARGE.size:
        return -1, 0
    (size,) = _LARGE.unpack_from(buffer, _SIZE.size)
    return size, _SIZE.size + _LARGE.size


__all__ = ["CHUNK", "SEND_TIMEOUT", "Frames", "Message", "SendTimeout", "send"]
