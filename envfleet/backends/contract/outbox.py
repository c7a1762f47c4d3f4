"""The pool's side of sending to a worker without ever blocking on it.

A command pipe (process backend) or socket (Ray actors on this machine) is written without
blocking: what it has no room for (a large command to a worker busy with an earlier one) waits
in the worker's :class:`Outbox` and is written as it drains, from the transport's ``wait``. So
a hung worker cannot hold up a ``submit`` past ``step_timeout``, nor deadlock against a worker
blocked writing a large reply.
"""

from __future__ import annotations

from collections.abc import Callable


class Outbox:
    """Bytes for one worker that its connection had no room for yet, oldest first.

    Args:
        write: writes what it can of the bytes it is given without blocking, and returns how
            many it wrote (``os.write`` on a non-blocking pipe, ``socket.send`` with
            ``MSG_DONTWAIT``); ``BlockingIOError`` when it has no room at all.
        watch: ``watch(True)``: bytes wait, tell me when the connection has room (the
            transport adds it to its poller); ``watch(False)``: nothing waits any more.
    """

    __slots__ = ("_buffer", "_watch", "_write")

    def __init__(self, write: Callable[[bytes | bytearray], int], watch: Callable[[bool], None]):
        self._buffer = bytearray()
        self._write = write
        self._watch = watch

    def __bool__(self) -> bool:
        return bool(self._buffer)

    def send(self, data: bytes) -> None:
        """Write ``data`` after whatever waits; what has no room waits in the outbox."""
        buffer = self._buffer
        if buffer:  # earlier bytes still wait for room: these go after them
            buffer += data
            return
        try:
            written = self._write(data)
        except BlockingIOError:
            written = 0
        except OSError:
            return  # the worker is gone: its transport hears of it on the next wait
        if written < len(data):
            buffer += data[written:]
            self._watch(True)

    def flush(self) -> None:
        """Write what waits, as far as the connection has room."""
        buffer = self._buffer
        try:
            while buffer:
                del buffer[: self._write(buffer)]
        except BlockingIOError:
            return
        except OSError:  # the worker is gone: its transport hears of it on the next wait
            buffer.clear()
        self._watch(False)

    def drop(self) -> None:
        """Forget what was never written (the worker was lost or replaced)."""
        if self._buffer:
            self._buffer.clear()
            self._watch(False)


__all__ = ["Outbox"]
