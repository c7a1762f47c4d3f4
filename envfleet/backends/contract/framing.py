"""The process backend's pipe wire: its bytes, written by the worker and read by the pool.

A command is one byte :data:`REPEAT` (run the previous command again: the pool sends the same
whole-group step every step) or :data:`FRAME`, a length and a pickle. A reply is one byte
:data:`PLAIN` (done, nothing to report), a :data:`COLUMNS` frame (nothing but infos of plain
scalars, as columns) or a frame (:func:`encode_reply`). :class:`FrameReader` reads replies on the
pool's side. A step that reports nothing costs one byte each way and no pickling. The loop that
serves this wire is :func:`~envfleet.backends.contract.channel.serve_pipes`.
"""

from __future__ import annotations

import functools
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from envfleet.backends.contract.replies import as_columns, plain, unpicklable
from envfleet.infos import Columns, column_dicts
from envfleet.protocol import Reply

__all__ = [
    "COLUMNS",
    "FRAME",
    "FRAME_BYTES",
    "LENGTH",
    "PLAIN",
    "PLAIN_BYTES",
    "READ_SIZE",
    "REPEAT",
    "REPEAT_BYTES",
    "FrameReader",
    "encode_reply",
    "frame",
    "read_exact",
    "write_all",
]

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
LENGTH = struct.Struct("<Q")
_HEADER = 1 + LENGTH.size
PLAIN_BYTES = bytes([PLAIN])
FRAME_BYTES = bytes([FRAME])
_COLUMNS_TAG = bytes([COLUMNS])
REPEAT_BYTES = bytes([REPEAT])


def frame(body: bytes) -> bytes:
    """``body`` as a framed message."""
    return bytes([FRAME]) + LENGTH.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the blocking descriptor ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exact(fd: int, n: int) -> bytes:
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
        return PLAIN_BYTES
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
        (_COLUMNS_TAG, LENGTH.pack(size), head, _ids_struct(len(named)).pack(*named), blob, data)
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
            if data == PLAIN_BYTES and not self._buffer:  # the hot path: one plain reply
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
            if data == PLAIN_BYTES:  # the hot path
                out.append(None)
                return
            if data[0] == COLUMNS and len(data) > _HEADER:  # the hot path of Atari, MuJoCo
                known = self._known
                if known is not None and len(data) == known[1] and data.startswith(known[0]):
                    columns = (known[3], known[4], data[len(known[0]) :])
                    out.append(self._columns((known[2], columns)))
                    return
                (size,) = LENGTH.unpack_from(data, 1)
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
            (size,) = LENGTH.unpack_from(buffer, pos + 1)
            if end - pos - header < size:
                break
            if buffer[pos] == COLUMNS:
                out.append(self._columns(_read_columns(buffer, pos + header, pos + header + size)))
            else:  # unpickled from the buffer itself (a rollout's reply: megabytes)
                with memoryview(buffer) as view, view[pos + header : pos + header + size] as body:
                    out.append(pickle.loads(body))
            pos += header + size
        del buffer[:pos]

    def _columns(self, message: tuple[tuple[int, ...], Columns]) -> Reply | None:
        env_ids, columns = message
        if self._infos is not None:
            self._infos(columns)
            return None
        return Reply(env_ids=env_ids, infos=column_dicts(columns))
