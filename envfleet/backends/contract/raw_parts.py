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
field, from the socket, and no array of the message to copy out of. A process worker's reply
pipe carries the same, as a :data:`~envfleet.backends.contract.landing.PARTS` frame
(:mod:`envfleet.backends.contract.landing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from envfleet.protocol import Reply
from envfleet.rollout_loop import Sampled

__all__ = ["LEAST_ROW", "RECORDED", "Raw", "destinations", "strip", "stripped"]

RECORDED = ("observations", "actions", "rewards", "terminations", "truncations")
"""A part's fields that travel as raw bytes, in this order (a nest's leaves in its order)."""


@dataclass(frozen=True)
class Raw:
    """An array of a part whose bytes follow the answer: its dtype and shape."""

    dtype: str
    shape: tuple[int, ...]


def _nest(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to the leaves of ``value`` (dicts and tuples of them), in order."""
    if isinstance(value, dict):
        return {key: _nest(fn, item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_nest(fn, item) for item in value)
    return fn(value)


def _parts(replies: Iterable[Any]) -> Iterable[tuple[Reply, Any, Sampled]]:
    """Each part among ``replies``' values, with its reply and key, in order."""
    for reply in replies:
        if isinstance(reply, Reply) and reply.values:
            for key, value in reply.values.items():
                if isinstance(value, Sampled):
                    yield reply, key, value


def strip(replies: Iterable[Any]) -> list[memoryview] | None:
    """The agent's side: each part among ``replies``' values with its recorded arrays swapped
    for :class:`Raw` (in its reply); the bytes of those arrays (views of them), in order, to
    send as the frame after the answer. ``None``: no part, no frame."""
    out: list[memoryview] = []
    found = False

    def raw(array: np.ndarray) -> Raw:
        array = np.ascontiguousarray(array)
        if array.size:
            out.append(array.reshape(-1).view(np.uint8).data)
        return Raw(array.dtype.str, array.shape)

    for reply, key, part in _parts(replies):
        found = True
        assert reply.values is not None
        swapped = {name: _nest(raw, getattr(part, name)) for name in RECORDED}
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
    part: Sampled, into: Sampled | None, empty: Callable[..., np.ndarray] = np.empty
) -> list[np.ndarray]:
    """The pool's side: ``part``'s recorded arrays set to ``into``'s where they fit (its steps,
    dtypes and shapes: the rollout's columns) and each step's block is large
    (:data:`LEAST_ROW`), else to new arrays (made by ``empty``); returns the buffers their
    bytes are read into, in order (flat ``uint8`` arrays: one per step of a column block)."""
    fits = into is not None and into.steps == part.steps and into.env_ids == part.env_ids
    buffers: list[np.ndarray] = []

    def land(raw: Raw, given: Any) -> np.ndarray:
        dtype = np.dtype(raw.dtype)
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
