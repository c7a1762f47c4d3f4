"""A rollout's parts between a worker (or a node's agent) and the pool: their recorded arrays
as raw bytes, read by the pool straight into the rollout's arrays.

::

    agent: G + pickle[(worker, reply)]: each part (Sampled) with its recorded arrays swapped
           for Raw (dtype, shape) + rows          ── one frame (small) ──►  pool
           the recorded arrays' bytes, in order   ── one frame ──────────►  read into the
                                                                            rollout's columns

Each part (:class:`~envfleet.rollout_loop.Sampled`) of an agent's answer travels with its
recorded arrays (observations, actions, rewards, terminations, truncations: ``steps`` rows a
field) swapped for :class:`Raw` descriptors (:func:`strip`), and their bytes follow as a frame of
their own, written from the arrays as they are. The pool reads the answer, finds where each
part's arrays go (:func:`destinations`: the columns of the rollout the pool gave for the part's
command, :class:`~envfleet.backends.LandsParts`, where they fit; else new arrays) and reads
that frame into them (:meth:`~envfleet.backends.nodes.frames.Frames.read_into`): one copy per
field, from the socket, and no array of the message to copy out of. With a node's
``compress=``, each observation array of frames travels as one compressed block per step
instead, read into a buffer of its own and decompressed straight into its columns
(:func:`unpack`): a float32 Pong frame is ~100 times smaller, and decompressing it costs the
pool's process about half what reading it raw from the socket did. A process worker's reply
pipe carries the same, as a :data:`~envfleet.backends.contract.landing.PARTS` frame
(:mod:`envfleet.backends.contract.landing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from envfleet.protocol import Reply
from envfleet.rollout_loop import Sampled

__all__ = [
    "LEAST_ROW",
    "RECORDED",
    "Codec",
    "Raw",
    "Unpack",
    "destinations",
    "recorded_arrays",
    "strip",
    "stripped",
    "unpack",
]

RECORDED = ("observations", "actions", "rewards", "terminations", "truncations")
"""A part's fields that travel as raw bytes, in this order (a nest's leaves in its order)."""


@dataclass(frozen=True)
class Raw:
    """An array of a part whose bytes follow the answer: its dtype and shape; ``packed``: the
    sizes of its steps' compressed blocks, in order, when it travels compressed (frames: see
    :func:`strip`)."""

    dtype: str
    shape: tuple[int, ...]
    packed: tuple[int, ...] = ()


class Codec(Protocol):
    """What compresses a part's frames (a node's ``compress=``:
    :class:`~envfleet.backends.nodes.compression.Codec`)."""

    def compress(self, data: Any) -> bytes: ...

    def decompress_into(self, data: np.ndarray, out: np.ndarray) -> None: ...


_NO_CODEC = "a rollout's frames came compressed to a pool without compress="

Unpack = tuple[np.ndarray, tuple[int, ...], np.ndarray]
"""A compressed array read: its blocks' bytes, their sizes, and the array they fill (a block
per step)."""


def _nest(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to the leaves of ``value`` (dicts and tuples of them), in order."""
    if isinstance(value, dict):
        return {key: _nest(fn, item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_nest(fn, item) for item in value)
    return fn(value)


def recorded_arrays(part: Sampled) -> list[np.ndarray]:
    """``part``'s recorded arrays (:data:`RECORDED`, each nest's leaves in order)."""
    found: list[np.ndarray] = []
    for name in RECORDED:
        _nest(found.append, getattr(part, name))
    return found


def _parts(replies: Iterable[Any]) -> Iterable[tuple[Reply, Any, Sampled]]:
    """Each part among ``replies``' values, with its reply and key, in order."""
    for reply in replies:
        if isinstance(reply, Reply) and reply.values:
            for key, value in reply.values.items():
                if isinstance(value, Sampled):
                    yield reply, key, value


def strip(replies: Iterable[Any], codec: Codec | None = None) -> list[memoryview] | None:
    """The agent's side: each part among ``replies``' values with its recorded arrays swapped
    for :class:`Raw` (in its reply); the bytes of those arrays (views of them), in order, to
    send as the frame after the answer. With ``codec``, each observation array of frames (two
    or more dimensions an env) goes as one compressed block per step instead (its sizes in its
    ``Raw``), as a node's rows do with ``compress=``. ``None``: no part, no frame."""
    out: list[memoryview] = []
    found = False

    def raw(array: np.ndarray, frames: bool = False) -> Raw:
        array = np.ascontiguousarray(array)
        if frames and codec is not None and array.size and array.ndim >= 4:
            blocks = [codec.compress(step) for step in array]
            out.extend(memoryview(block) for block in blocks)
            return Raw(array.dtype.str, array.shape, tuple(len(block) for block in blocks))
        if array.size:
            out.append(array.reshape(-1).view(np.uint8).data)
        return Raw(array.dtype.str, array.shape)

    def frames(array: np.ndarray) -> Raw:
        return raw(array, frames=True)

    for reply, key, part in _parts(replies):
        if part.in_place:  # recorded where the pool reads it: nothing follows
            continue
        found = True
        assert reply.values is not None
        swapped = {
            name: _nest(frames if name == "observations" else raw, getattr(part, name))
            for name in RECORDED
        }
        reply.values[key] = dataclasses.replace(part, **swapped)
    return out if found else None


def stripped(reply: Any) -> list[Sampled]:
    """The pool's side: the parts of ``reply`` whose arrays follow the answer."""
    return [part for _, _, part in _parts([reply]) if isinstance(part.rewards, Raw)]


LEAST_ROW = 4096
"""The bytes of a step's column block below which a field is read whole into an array of its
own and copied into its columns by NumPy: a read per step of CartPole's 128-byte rows cost the
pool's process 2.7x the CPU of one read and one copy (a Pong frame's rows are 450 KB)."""


def destinations(
    part: Sampled,
    into: Sampled | None,
    empty: Callable[..., np.ndarray] = np.empty,
    unpacks: list[Unpack] | None = None,
) -> list[np.ndarray]:
    """The pool's side: ``part``'s recorded arrays set to ``into``'s where they fit (its steps,
    dtypes and shapes: the rollout's columns) and each step's block is large
    (:data:`LEAST_ROW`), else to new arrays (made by ``empty``); returns the buffers their
    bytes are read into, in order (flat ``uint8`` arrays: one per step of a column block). An
    array that travels compressed is read into a buffer of its blocks, added to ``unpacks``
    for :func:`unpack` to decompress into its steps once read.

    Raises:
        ValueError: a compressed array, and no ``unpacks`` to decompress it.
    """
    fits = into is not None and into.steps == part.steps and into.env_ids == part.env_ids
    buffers: list[np.ndarray] = []

    def land(raw: Raw, given: Any) -> np.ndarray:
        dtype = np.dtype(raw.dtype)
        if raw.packed:
            if unpacks is None:
                raise ValueError(_NO_CODEC)
            fit = isinstance(given, np.ndarray) and (given.shape, given.dtype) == (raw.shape, dtype)
            array = given if fit and _rows_contiguous(given) else empty(raw.shape, dtype)
            blocks = np.empty(sum(raw.packed), np.uint8)
            buffers.append(blocks)
            unpacks.append((blocks, raw.packed, array))
            return array
        if (
            isinstance(given, np.ndarray)
            and (given.shape, given.dtype) == (raw.shape, dtype)
            and _rows_contiguous(given)
            and (given.flags.c_contiguous or given[0].nbytes >= LEAST_ROW)
        ):
            buffers.extend(_flat(given))
            return given
        array = empty(raw.shape, dtype)
        buffers.extend(_flat(array))
        return array

    def each(name: str) -> Any:
        got = getattr(part, name)
        given = getattr(into, name) if fits else None
        return _zip_nest(land, got, given)

    landed = {name: each(name) for name in RECORDED}
    for name, value in landed.items():
        setattr(part, name, value)
    return buffers


def unpack(unpacks: list[Unpack], codec: Codec | None) -> None:
    """Decompress each read array's blocks into its steps (see :func:`destinations`).

    Raises:
        ValueError: no ``codec``, or a block that does not fill its step.
    """
    if not unpacks:
        return
    if codec is None:
        raise ValueError(_NO_CODEC)
    for blocks, sizes, array in unpacks:
        at = 0
        for step, size in zip(array, sizes, strict=True):
            codec.decompress_into(blocks[at : at + size], step)
            at += size


def _zip_nest(fn: Callable[[Raw, Any], np.ndarray], raws: Any, given: Any) -> Any:
    """``fn(raw, given)`` for the leaves of ``raws`` and of ``given`` laid out alike
    (``given`` ``None`` or another layout: ``None`` for each)."""
    if isinstance(raws, dict):
        same = isinstance(given, dict) and given.keys() == raws.keys()
        return {k: _zip_nest(fn, v, given[k] if same else None) for k, v in raws.items()}
    if isinstance(raws, tuple):
        same = isinstance(given, tuple) and len(given) == len(raws)
        return tuple(_zip_nest(fn, v, given[k] if same else None) for k, v in enumerate(raws))
    return fn(raws, given)


def _rows_contiguous(array: np.ndarray) -> bool:
    """Whether ``array`` is contiguous, or each row of its first axis is (all alike)."""
    return bool(array.flags.c_contiguous or (array.ndim > 1 and array[0].flags.c_contiguous))


def _flat(array: np.ndarray) -> list[np.ndarray]:
    """``array``'s memory as flat ``uint8`` buffers, in order: one when it is contiguous,
    else one per row of its first axis (a column block of a rollout's array: each step's
    columns are contiguous)."""
    if not array.size:
        return []
    if array.flags.c_contiguous:
        return [array.reshape(-1).view(np.uint8)]
    return [row.reshape(-1).view(np.uint8) for row in array]
