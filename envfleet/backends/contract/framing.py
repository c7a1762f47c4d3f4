"""The process backend's pipe wire: its bytes, written by the worker and read by the pool.

A command is one byte :data:`REPEAT` (run the previous command again: the pool sends the same
whole-group step every step) or :data:`FRAME`, a length and a pickle. A reply is one byte
:data:`PLAIN` (done, nothing to report), a :data:`COLUMNS` frame (nothing but infos of plain
scalars, as columns), a frame, or a :data:`BUFFERS` frame when it holds large arrays (a
rollout's part: megabytes of frames) (:func:`encode_reply`). :class:`FrameReader` reads replies
on the pool's side. A step that reports nothing costs one byte each way and no pickling. The
loop that serves this wire is :func:`~envfleet.backends.contract.channel.serve_pipes`.

A large array travels as it is, after the pickle (pickle's protocol 5 out of band): the worker
writes it from the array itself, and the pool reads a large reply straight into memory of its
size and unpickles the arrays as views of it. Rollouts of Pong frames (float32) on 2 workers
cost the pool's process 194 µs an env-step when each part was read in 64 KB pieces into a
growing buffer and copied out of the pickle.
"""

from __future__ import annotations

import functools
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from envfleet import out_of_band
from envfleet.backends.contract.landing import IOV_MAX, PARTS, Landing, ReplyPickler, encode_parts
from envfleet.backends.contract.replies import as_columns, plain, unpicklable
from envfleet.info_columns import Columns, column_dicts
from envfleet.protocol import Reply
from envfleet.recycling import Recycler
from envfleet.rollout_loop import Sampled

__all__ = [
    "BUFFERS",
    "COLUMNS",
    "FRAME",
    "FRAME_BYTES",
    "IN_PLACE",
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
and the records (:data:`~envfleet.info_columns.Columns`)."""
BUFFERS = 3
"""Tag of a framed reply whose large buffers follow its pickle: a length, then the pickle's
length, the pickle, the count of buffers, their lengths, and each buffer 16-byte aligned in the
frame's body (:func:`encode_reply`)."""
IN_PLACE = 1 << 20
"""A reply this large is read straight into memory of its own (not piece by piece into the
reader's buffer)."""
READ_SIZE = 1 << 16
"""Bytes :meth:`FrameReader.read` asks of a pipe at a time (a shorter read: it is empty)."""
_COLUMNS_HEAD = struct.Struct("<III")
LENGTH = struct.Struct("<Q")
_HEADER = 1 + LENGTH.size
PLAIN_BYTES = bytes([PLAIN])
FRAME_BYTES = bytes([FRAME])
_COLUMNS_TAG = bytes([COLUMNS])
_BUFFERS_TAG = bytes([BUFFERS])
REPEAT_BYTES = bytes([REPEAT])


def frame(body: bytes) -> bytes:
    """``body`` as a framed message."""
    return bytes([FRAME]) + LENGTH.pack(len(body)) + body


def write_all(fd: int, data: bytes | list[bytes | memoryview]) -> None:
    """Write all of ``data`` (bytes, or pieces written with ``writev``) to the blocking
    descriptor ``fd``."""
    if not isinstance(data, list):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        return
    pieces = [memoryview(piece).cast("B") for piece in data if len(piece)]
    while pieces:
        sent = os.writev(fd, pieces[:IOV_MAX])
        while pieces and sent >= pieces[0].nbytes:
            sent -= pieces.pop(0).nbytes
        if sent:
            pieces[0] = pieces[0][sent:]


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


def encode_reply(reply: Reply) -> bytes | list[bytes | memoryview]:
    """A reply on the wire: one byte when plain; a :data:`COLUMNS` frame when it carries only
    infos of plain scalars (:func:`~envfleet.info_columns.info_columns`); a :data:`BUFFERS`
    frame, as pieces for one ``writev``, when it holds large arrays; else a frame (an
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
        parts = encode_parts(reply)  # a rollout's part: its arrays' bytes after the reply
        if parts is not None:
            return parts
        body, buffers = out_of_band.dumps(reply, pickler=ReplyPickler)
    except Exception as exc:  # an info or call result that cannot be pickled
        failed = Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),))
        body, buffers = out_of_band.dumps(failed, pickler=ReplyPickler)
    if not buffers:
        return frame(bytes(body))
    pieces = out_of_band.laid_out(body, buffers)
    return [_BUFFERS_TAG + LENGTH.pack(sum(map(len, pieces))), *pieces]


def _decode(tag: int, body: np.ndarray) -> Any:
    """What a whole frame's ``body`` holds: a :data:`BUFFERS` frame's arrays views of it."""
    return out_of_band.loads(body.data)[0] if tag == BUFFERS else pickle.loads(body.data)


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
        # A reply whose bytes are under way straight where they go (:mod:`.landing`): a
        # rollout's parts into their arrays, a large reply (:data:`IN_PLACE`) into its body.
        self._parts: Landing | None = None
        # Large replies' memory (bodies, parts' own arrays): used again once their arrays are
        # dropped; one block of each size kept, gone with the reader.
        self._memory = Recycler(keep=1)
        self.landing: dict[tuple[int, ...], Sampled] = {}
        """The arrays the pool gave for the part of these envs' rollout (their columns: the
        transport's ``land``), taken when it comes."""

    @property
    def partial(self) -> bool:
        """Part of a reply has arrived, not all of it."""
        return bool(self._buffer) or self._parts is not None

    def read(self, fd: int, out: list[Reply | None]) -> bool:
        """Read what the non-blocking ``fd`` holds and :meth:`feed` it; False at EOF."""
        while True:
            if self._parts is not None:  # straight where it goes: its arrays, its body
                parts = self._parts
                try:
                    n = os.readv(fd, parts.iovecs())
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not n:
                    return False
                parts.advance(n)
                if parts.done:
                    self._parts = None
                    out.append(parts.reply())
                continue
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
        if self._parts is not None:
            parts = self._parts
            data = data[parts.fill(data) :]
            if parts.done:
                self._parts = None
                out.append(parts.reply())
            if not data:
                return
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
            tag = buffer[pos]
            if tag == PARTS:  # the pickle, then its parts' bytes: into their arrays
                if end - pos < header + size + LENGTH.size:
                    break
                (raw,) = LENGTH.unpack_from(buffer, pos + header + size)
                with memoryview(buffer) as view, view[pos + header : pos + header + size] as p:
                    parts = Landing.of(p, raw, self.landing, self._memory.empty)
                pos += header + size + LENGTH.size
                with memoryview(buffer) as view, view[pos:end] as rest:
                    pos += parts.fill(rest)
                if parts.done:
                    out.append(parts.reply())
                    continue
                self._parts = parts  # the rest of its bytes: read in place
                break
            if end - pos - header < size:
                if size >= IN_PLACE and tag != COLUMNS:  # the rest read straight into its own
                    body = self._memory.empty(size, np.uint8)
                    got = end - pos - header
                    body[:got] = np.frombuffer(buffer, np.uint8, got, pos + header)
                    self._parts = Landing.whole(body, got, functools.partial(_decode, tag, body))
                    pos = end
                break
            start, stop = pos + header, pos + header + size
            if tag == COLUMNS:
                out.append(self._columns(_read_columns(buffer, start, stop)))
            elif tag == BUFFERS:  # its arrays are views: of memory of their own
                body = self._memory.empty(size, np.uint8)
                body[:] = np.frombuffer(buffer, np.uint8, size, start)
                out.append(_decode(tag, body))
            else:  # unpickled from the buffer itself (no view of it outlives the call)
                with memoryview(buffer) as view, view[start:stop] as pickled:
                    out.append(pickle.loads(pickled))
            pos += header + size
        del buffer[:pos]

    def _columns(self, message: tuple[tuple[int, ...], Columns]) -> Reply | None:
        env_ids, columns = message
        if self._infos is not None:
            self._infos(columns)
            return None
        return Reply(env_ids=env_ids, infos=column_dicts(columns))
