"""The messages between a pool and its node agents: one per node per command round.

::

    pool (driver)                                     node agent (one per node)
    ─────────────                                     ─────────────────────────
    R + action rows ─────── "the same round again" ─► write the rows into its batch, submit
    S + len + pickle[(worker, command)] + actions ──►   each command to its local worker
                                                      wait for the local replies (its pipes)
    rows into the batch arrays ◄──── P + rows ─────── every command answered, nothing to say
      (np.frombuffer + one slice   ◄─ I + columns + rows  nothing to say but infos of plain
       assignment per field;                          scalars (Atari's, MuJoCo's): columns
       columns into its InfoTable)   G + len + pickle[([(worker, reply)], columns)]
                                        + large buffers + rows
                                                      (dict infos, failures, a lost worker,
                                                      a rollout: its arrays after the pickle)
    K + worker (2 bytes) ───────────────────────────► kill a hung local worker (reported lost)
    X + pickle((worker, restarts)) ─────────────────► rebuild one local worker; A + pickle(error)
    C ──────────────────────────────────────────────► close; A, then the agent's loop ends
    M ──────────────────────────────────────────────► its workers' resident memory:
      (worker_memory_limit)        ◄──── M + int64 bytes per local worker (-1: unknown)

``worker`` is the agent's own (local) worker index. Rows travel as the raw bytes of each field
(observation leaves, rewards, terminations, truncations), for the envs of the round's
:class:`~envfleet.protocol.EnvCommand` s in a canonical order both sides compute from the same
commands (:func:`row_ids`); a step's actions travel the same way. Spaces that are not arrays
(pickled path) carry their observations in the pickled part instead. With ``compress=``, the
rows of each image field (:mod:`envfleet.backends.nodes.compression`) travel instead as one
compressed block, its length (8 bytes) first. Infos that the workers sent as columns
(:func:`~envfleet.infos.info_columns`: one record per env) travel as they came, those of one
layout joined (:func:`join_columns`), and go into the pool's
:class:`~envfleet.infos.InfoTable` with no Python per env; other infos are the replies' dicts.
In the general answer to a rollout, buffers of 64 KB or more (its arrays) travel after the
pickle (pickle's protocol 5, out of band) and are unpickled as views of the message: neither
end copies them in or out of the pickle.
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from envfleet.backends.nodes.compression import Codec, compressible
from envfleet.buffers import ObjectRows
from envfleet.errors import EnvError, EnvTimeoutError, WorkerDiedError
from envfleet.infos import Columns
from envfleet.protocol import Command, EnvCommand, EnvFailure, Reply, Step

REPEAT = b"R"
SUBMIT = b"S"
PLAIN = b"P"
INFOS = b"I"
GENERAL = b"G"
RESTART = b"X"
CLOSE = b"C"
KILL = b"K"
ACK = b"A"
MEMORY = b"M"
_LENGTH = struct.Struct("<Q")
_COUNT = struct.Struct("<H")

Codecs = Sequence[Codec | None] | None
"""Per row field, the codec that compresses it (``None``: no field is compressed)."""


def leaves(value: Any) -> list[np.ndarray]:
    """The arrays of a batch field (a Dict/Tuple nest of arrays) in a fixed order."""
    if isinstance(value, dict):
        return [leaf for key in value for leaf in leaves(value[key])]
    if isinstance(value, tuple):
        return [leaf for part in value for leaf in leaves(part)]
    assert isinstance(value, np.ndarray)
    return [value]


def selection(ids: np.ndarray) -> slice | np.ndarray:
    """``ids`` as a slice when they are consecutive (a view, one copy), else themselves."""
    if ids.size and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1)):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def pack(
    fields: Sequence[np.ndarray], sel: slice | np.ndarray, codecs: Codecs = None
) -> list[bytes]:
    """The bytes of rows ``sel`` of each array of ``fields``; a field with a codec in
    ``codecs`` (see :func:`row_codecs`) as its compressed block, its length first (nothing when
    there are no rows)."""
    if not codecs:
        return [field[sel].tobytes() for field in fields]
    out = []
    for field, codec in zip(fields, codecs, strict=True):
        rows = np.ascontiguousarray(field[sel])
        if codec is None:
            out.append(rows.tobytes())
        elif rows.shape[0]:
            blob = codec.compress(rows.reshape(-1))
            out += [_LENGTH.pack(len(blob)), blob]
    return out


def unpack(
    fields: Sequence[np.ndarray],
    sel: slice | np.ndarray,
    n: int,
    data: Any,
    at: int,
    codecs: Codecs = None,
) -> int:
    """Write ``n`` rows from ``data`` (from offset ``at``) into rows ``sel`` of each of
    ``fields`` (compressed blocks, for the fields with a codec in ``codecs``, decompressed
    straight into them where ``sel`` is a slice); return the offset after them."""
    if n == 0:
        return at
    first = 0
    if not codecs and isinstance(sel, slice):  # a node's rows in a run (a sync step)
        first, at = _copy_rows(fields, sel, data, at)
    for k in range(first, len(fields)):  # the rest (a field with no plain buffer: from it)
        field = fields[k]
        shape = field.shape[1:]
        codec = codecs[k] if codecs else None
        if codec is not None:
            (size,) = _LENGTH.unpack_from(data, at)
            at += _LENGTH.size
            block = np.frombuffer(data, np.uint8, size, at)
            at += size
            if isinstance(sel, slice):
                codec.decompress_into(block, field[sel])
            else:
                unpacked = np.empty((n, *shape), field.dtype)
                codec.decompress_into(block, unpacked)
                field[sel] = unpacked
            continue
        count = n * math.prod(shape)
        field[sel] = np.frombuffer(data, field.dtype, count, at).reshape((n, *shape))
        at += count * field.itemsize
    return at


def row_views(fields: Sequence[np.ndarray], sel: slice | np.ndarray) -> list[memoryview] | None:
    """The bytes of rows ``sel`` of each of ``fields`` as one flat view into it, when ``sel`` is
    a run of rows (a slice) and every field's rows are contiguous with a buffer format
    (``None`` otherwise): kept for a round that repeats, its rows are packed by joining these,
    and unpacked by :func:`copy_into`, with no numpy call."""
    if not isinstance(sel, slice):
        return None
    views = []
    for field in fields:
        rows = field[sel]
        if not rows.flags.c_contiguous:
            return None
        try:
            views.append(rows.data.cast("B"))
        except (TypeError, ValueError):
            return None
    return views


def copy_into(views: Sequence[memoryview], data: Any, at: int) -> int:
    """Fill each of ``views`` in turn from ``data``'s bytes from offset ``at`` (one ``memcpy``
    each); return the offset after them."""
    source = memoryview(data)
    for view in views:
        end = at + view.nbytes
        view[:] = source[at:end]
        at = end
    return at


def _copy_rows(fields: Sequence[np.ndarray], sel: slice, data: Any, at: int) -> tuple[int, int]:
    """Copy rows ``sel`` of each of ``fields`` from ``data`` (from offset ``at``) as raw bytes,
    one ``memcpy`` each (half the cost of a numpy assignment for a node's small rows); return
    how many fields it copied (it stops at one that is not contiguous, has a type with no
    buffer format, or is short of bytes: left to numpy) and the offset after them."""
    view = memoryview(data)
    for k, field in enumerate(fields):
        rows = field[sel]
        size = rows.nbytes
        if not rows.flags.c_contiguous or len(view) < at + size:
            return k, at
        try:
            target = rows.data.cast("B")
        except (TypeError, ValueError):
            return k, at
        target[:] = view[at : at + size]
        at += size
    return len(fields), at


def row_codecs(fields: Sequence[np.ndarray], codec: Codec | None) -> Codecs:
    """Which of a round's row ``fields`` travel compressed with ``codec`` (the images: see
    :func:`~envfleet.backends.nodes.compression.compressible`); ``None``: none."""
    if codec is None:
        return None
    codecs = [codec if compressible(field) else None for field in fields]
    return codecs if any(c is not None for c in codecs) else None


def plain_workers(workers: Sequence[int]) -> bytes:
    """Which local workers a plain answer answers (one command each, in this order)."""
    return _COUNT.pack(len(workers)) + np.asarray(workers, dtype=np.uint16).tobytes()


def read_plain_workers(data: Any) -> tuple[bytes, int]:
    """The workers part of a plain answer (as bytes, a cache key), and the offset after it."""
    (n,) = _COUNT.unpack_from(data, 1)
    end = 1 + _COUNT.size + 2 * n
    return bytes(data[1:end]), end


def join_columns(parts: Sequence[Columns]) -> list[Columns]:
    """The columns of an answer's replies, those of one layout joined in one (by env, in
    order: a node's envs are consecutive, so they usually land with one slice assignment)."""
    if len(parts) == 1:
        return list(parts)
    joined: dict[bytes, list[Columns]] = {}
    for part in sorted(parts, key=_first_env):
        joined.setdefault(part[1], []).append(part)
    return [
        (
            tuple(i for ids, _, _ in same for i in ids),
            layout,
            b"".join([data for _, _, data in same]),
        )
        for layout, same in joined.items()
    ]


def _first_env(columns: Columns) -> int:
    return columns[0][0]


def pickled(body: Any) -> bytes:
    """``body`` pickled, its length first."""
    blob = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(blob)) + blob


def read_pickled(data: Any, at: int) -> tuple[Any, int]:
    """What :func:`pickled` wrote at offset ``at``, and the offset after it."""
    (size,) = _LENGTH.unpack_from(data, at)
    start = at + _LENGTH.size
    return pickle.loads(memoryview(data)[start : start + size]), start + size  # no copy first


def memory(used: Sequence[int | None]) -> bytes:
    """An agent's answer to :data:`MEMORY`: the resident bytes of each of its workers."""
    return MEMORY + np.array([-1 if u is None else u for u in used], dtype=np.int64).tobytes()


def read_memory(data: Any) -> list[int | None]:
    """The bytes of each worker in an answer to :data:`MEMORY` (``None``: unknown)."""
    values = np.frombuffer(data, np.int64, offset=1).tolist()
    return [None if v < 0 else int(v) for v in values]


def header(tag: bytes, body: Any) -> bytes:
    """``tag``, then ``body`` pickled with its length first."""
    return tag + pickled(body)


OUT_OF_BAND = 1 << 16
"""In the answer to a rollout, a buffer (an array's data) this large travels after the pickle,
not inside it: not copied into the pickle by the agent, nor out of it by the pool."""

_ALIGN = 16


def header_parts(tag: bytes, body: Any, out_of_band: bool = False) -> list[bytes | memoryview]:
    """``tag``, then ``body`` pickled (its length first); with ``out_of_band``, its large
    buffers after it: their count and lengths, then each, 16-byte aligned in the message, as
    it is (the parts are written by one ``writev``, not joined). Read by
    :func:`read_header_parts`, whose arrays are then views of the message: only for what the
    pool copies out at once (a rollout's parts), else a value the caller keeps would keep the
    whole message alive."""
    buffers: list[memoryview] = []

    def inside(buffer: pickle.PickleBuffer) -> bool:
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: pickled inside, as always
            return True
        if raw.nbytes < OUT_OF_BAND:
            return True
        buffers.append(raw)
        return False

    blob = pickle.dumps(body, protocol=5, buffer_callback=inside if out_of_band else None)
    sizes = [_LENGTH.pack(len(blob)), blob, _LENGTH.pack(len(buffers))]
    sizes += [_LENGTH.pack(b.nbytes) for b in buffers]
    head = tag + b"".join(sizes)
    parts: list[bytes | memoryview] = [head]
    at = len(head)
    for buffer in buffers:
        pad = -at % _ALIGN
        if pad:
            parts.append(bytes(pad))
        parts.append(buffer)
        at += pad + buffer.nbytes
    if pad := -at % _ALIGN:  # what follows (rows) starts aligned too
        parts.append(bytes(pad))
    return parts


def read_header_parts(data: Any) -> tuple[Any, int]:
    """What :func:`header_parts` wrote after its tag, and the offset of what follows it: the
    large buffers' arrays are views of ``data`` (of a copy if ``data`` is read-only: they
    are writable, as those pickled inside are)."""
    (size,) = _LENGTH.unpack_from(data, 1)
    start = 1 + _LENGTH.size
    at = start + size
    (count,) = _LENGTH.unpack_from(data, at)
    sizes = struct.unpack_from(f"<{count}Q", data, at + _LENGTH.size)
    at += _LENGTH.size * (1 + count)
    view = memoryview(data)
    if count and view.readonly:
        view = memoryview(bytearray(view))
    buffers = []
    for n in sizes:
        at += -at % _ALIGN
        buffers.append(view[at : at + n])
        at += n
    at += -at % _ALIGN
    return pickle.loads(view[start : start + size], buffers=buffers), at


def read_header(data: Any) -> tuple[Any, int]:
    """The pickled body after a tag, and the offset of what follows it."""
    return read_pickled(data, 1)


def action_ids(commands: Iterable[Command]) -> np.ndarray:
    """The envs whose actions travel with ``commands``: those of each step that carries none."""
    parts = [c.env_ids for c in commands if isinstance(c, Step) and c.actions is None]
    if not parts:
        return np.empty(0, dtype=np.intp)
    return np.fromiter((i for ids in parts for i in ids), dtype=np.intp)


def row_ids(answered: Iterable[tuple[Command, Reply | None]]) -> np.ndarray:
    """The envs whose rows travel back for these answered commands, in order: each env
    command's envs, less those that failed (a command that failed as a whole has none)."""
    out: list[int] = []
    for command, reply in answered:
        if not isinstance(command, EnvCommand):
            continue
        if reply is None or not reply.failures:
            out.extend(command.env_ids)
            continue
        failed = {f.env_index for f in reply.failures}
        if None in failed:
            continue
        out.extend(i for i in command.env_ids if i not in failed)
    return np.array(out, dtype=np.intp)


def row_fields(batch: Any) -> list[np.ndarray]:
    """The arrays a round's rows are read from or written to (observations when arrays)."""
    fields = [] if isinstance(batch.observations, ObjectRows) else leaves(batch.observations)
    return [*fields, batch.rewards, batch.terminations, batch.truncations]


Portable = tuple[Any, ...]
"""An :class:`~envfleet.errors.EnvError` in a form that pickles (the error itself does not:
its ``__init__`` takes keyword arguments, and an env's error is an instance of a class made on
the fly), see :func:`portable` and :func:`rebuild`."""


def portable(exc: EnvError) -> Portable:
    """``exc`` as plain data, to cross to the pool."""
    if isinstance(exc, WorkerDiedError):
        return (
            "died",
            isinstance(exc, EnvTimeoutError),
            str(exc),
            exc.env_index,
            exc.phase,
            exc.worker,
            exc.exitcode,
            exc.env_ids,
        )
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return ("raised", EnvFailure.capture(exc.env_index, exc.phase, cause), exc.worker)


def rebuild(data: Portable, workers: Sequence[int], env_name: str) -> Exception:
    """The error :func:`portable` describes, naming the pool's worker (``workers``: the pool's
    index of each of the agent's workers); ``("missing", message)``: a module the node lacks,
    an ``ImportError``."""
    if data[0] == "missing":
        return ImportError(data[1])
    if data[0] == "raised":
        _, failure, worker = data
        error: EnvError = failure.to_error(workers[worker], env_name)
        return error
    _, timeout, message, env_index, phase, worker, exitcode, env_ids = data
    kind = EnvTimeoutError if timeout else WorkerDiedError
    return kind(
        message,
        env_index=env_index,
        phase=phase,
        worker=workers[worker],
        exitcode=exitcode,
        env_ids=env_ids,
    )


__all__ = [
    "ACK",
    "CLOSE",
    "GENERAL",
    "INFOS",
    "KILL",
    "MEMORY",
    "OUT_OF_BAND",
    "PLAIN",
    "REPEAT",
    "RESTART",
    "SUBMIT",
    "Codecs",
    "Portable",
    "action_ids",
    "copy_into",
    "header",
    "header_parts",
    "join_columns",
    "leaves",
    "memory",
    "pack",
    "pickled",
    "plain_workers",
    "portable",
    "read_header",
    "read_header_parts",
    "read_memory",
    "read_pickled",
    "read_plain_workers",
    "rebuild",
    "row_codecs",
    "row_fields",
    "row_ids",
    "row_views",
    "selection",
    "unpack",
]
