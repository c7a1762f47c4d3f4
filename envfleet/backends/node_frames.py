"""Messages on a pool-agent connection: whole ones in, in as few reads as the bytes allow; out
in one write, from their parts.

Both ends of the connection between a pool and a node agent write ``multiprocessing``'s frames
(:meth:`~multiprocessing.connection.Connection.send_bytes`: a 4-byte big-endian length, then
the message; ``-1`` and an 8-byte length past 2 GiB). Its ``recv_bytes`` reads a frame in two
reads at least (the length, then the message), through a ``BytesIO``, and its ``poll`` builds a
selector at each call. :class:`Frames` reads what the socket holds, up to :data:`CHUNK`, in one
read: a round's message, or a node's answer of small rows, is one system call, and what came
after it is kept for the next :meth:`Frames.read` (so a message can be whole here while the
socket has nothing more to read: ask :meth:`Frames.whole` before waiting on the socket).
:func:`send` writes a message the same way, its length and its parts (a node's rows: views of
its batch) in one ``writev``, where ``send_bytes`` takes one ``bytes`` (the parts joined) and
copies it again behind its length.
"""

from __future__ import annotations

import os
import select
import struct
from collections.abc import Sequence

CHUNK = 1 << 16
"""Bytes asked for at each read of a message's start (a larger message's rest is read into a
buffer of its size)."""

Message = bytes | bytearray
"""A message as :meth:`Frames.read` returns it: a large one is the buffer it was read into."""

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


def send(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write one message, ``parts`` one after the other, to the connection's descriptor ``fd``
    (blocking), framed as ``Connection.send_bytes`` frames it; return its length."""
    size = sum([len(part) for part in parts])  # each a bytes-like of single bytes
    header = _SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LARGE.pack(size)
    chunks = [header, *parts]
    sent = os.writev(fd, chunks)
    if sent < len(header) + size:  # a blocking socket writes all of it, unless a signal came
        rest = memoryview(b"".join(chunks))[sent:]
        while rest:
            rest = rest[os.write(fd, rest) :]
    return size


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
