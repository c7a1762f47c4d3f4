"""A round's rows as raw bytes per field, between a pool and its node agents.

Rows travel as the raw bytes of each field (:func:`row_fields`: observation leaves, rewards,
terminations, truncations), for the envs of the round's :class:`~envfleet.protocol.EnvCommand` s
in a canonical order both sides compute from the same commands (:func:`row_ids`); a step's
actions travel the same way (:func:`action_ids`). :func:`pack` and :func:`unpack` write and read
them (a node's rows in a run: one ``memcpy`` per field); with ``compress=``, the rows of each
image field (:func:`row_codecs`) travel as one compressed block, its length (8 bytes) first. A
round that repeats keeps views of its rows (:func:`row_views`, :func:`copy_into`). The messages
around them are :mod:`envfleet.backends.nodes.wire`'s.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from envfleet.backends.contract.base import TransportOptions
from envfleet.backends.nodes.compression import Codec, compressible
from envfleet.buffers import Batch, ObjectRows
from envfleet.protocol import Command, EnvCommand, Reply, Step

__all__ = [
    "Codecs",
    "action_fields",
    "action_ids",
    "check_compress",
    "copy_into",
    "frames_codec",
    "leaves",
    "pack",
    "row_codecs",
    "row_fields",
    "row_ids",
    "row_views",
    "selection",
    "unpack",
]

_LENGTH = struct.Struct("<Q")

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


def action_fields(batch: Any) -> list[np.ndarray]:
    """The arrays a step's actions are read from or written to (none when they are not
    arrays: they travel in the pickled commands)."""
    return [] if isinstance(batch.actions, ObjectRows) else leaves(batch.actions)


def check_compress(compress: str | None, codec: Codec | None, options: TransportOptions) -> None:
    """Refuse ``compress=`` for a pool whose rows have nothing it compresses."""
    probe = row_fields(Batch.local(options.observation_space, options.action_space, 1))
    if compress is not None and row_codecs(probe, codec) is None:
        raise ValueError(
            f"compress={compress!r} compresses image observations (arrays of numbers of two or "
            f"more dimensions a row); {options.observation_space} has none"
        )


def row_codecs(fields: Sequence[np.ndarray], codec: Codec | None) -> Codecs:
    """Which of a round's row ``fields`` travel compressed with ``codec`` (the images: see
    :func:`~envfleet.backends.nodes.compression.compressible`); ``None``: none."""
    if codec is None:
        return None
    codecs = [codec if compressible(field) else None for field in fields]
    return codecs if any(c is not None for c in codecs) else None


def frames_codec(codecs: Codecs) -> Codec | None:
    """The codec of a pool's image fields (``None``: none), which compresses its rollouts'
    frames too (:func:`~envfleet.backends.contract.raw_parts.strip`)."""
    return next((c for c in codecs if c is not None), None) if codecs else None


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
