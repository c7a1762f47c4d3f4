"""Batched arrays laid out from Gymnasium spaces, in shared or local memory.

One array per field (observations, actions, rewards, terminations, truncations) holds every env
of the pool; env ``i`` owns row ``i``. Workers write their rows in place, so observations never
travel through a pipe on the hot path. Box, Discrete, MultiDiscrete, MultiBinary and Dict/Tuple
nests of them are shared; any other space (Text, Graph, Sequence, OneOf, custom) falls back to a
Python list per pool whose entries the workers send back pickled. How one env's row is written
and read, per space, is :mod:`envfleet.row_access`'s.
"""

from __future__ import annotations

import ctypes
import multiprocessing.context
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import singledispatch
from typing import Any, Protocol

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet.infos import InfoTable

_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def is_array_space(space: spaces.Space[Any]) -> bool:
    """Whether ``space`` batches into fixed-shape numpy arrays (and so into shared memory)."""
    if isinstance(space, _ARRAY_SPACES):
        return True
    if isinstance(space, spaces.Dict):
        return all(is_array_space(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(is_array_space(s) for s in space.spaces)
    return False


class ObjectRows(list[Any]):
    """Per-env storage for observations of spaces that do not fit arrays (pickled path)."""


_CASTS: dict[tuple[Any, np.dtype[Any]], bool] = {}
"""Whether a source dtype (or Python scalar type) casts into a target dtype by the same_kind
rule, per pair met so far: a handful per pool."""


def fits_dtype(value: Any, dtype: np.dtype[Any]) -> bool:
    """Whether ``value`` goes into an array of ``dtype`` as Gymnasium's vector envs write their
    observations (``concatenate``: ``np.stack(..., out=)``, numpy's ``same_kind`` casting, each
    observation taken on its own): int64 into int32 or float64 into float32 yes; float into an
    integer dtype, a signed into an unsigned one, an int into bool, no.

    Cheap when called per step: one dict lookup per observation of another dtype than the
    batch's (the answer is kept per pair of dtypes)."""
    source = getattr(value, "dtype", None)
    if source is dtype:
        return True
    if isinstance(source, np.dtype):
        key: Any = source
    elif type(value) in (int, float, bool, complex):
        key = type(value)
    else:  # another array-like (its dtype is not numpy's), a list: what numpy makes of it
        key = np.asarray(value).dtype
    fits = _CASTS.get((key, dtype))
    if fits is None:
        source = key if isinstance(key, np.dtype) else np.asarray(value).dtype
        fits = _CASTS[(key, dtype)] = bool(np.can_cast(source, dtype, "same_kind"))
    return fits


# ---------------------------------------------------------------------------------------------
# Shared allocation: raw bytes (no lock, so no named semaphore to leak) viewed as numpy arrays.


@singledispatch
def allocate_shared(space: spaces.Space[Any], n: int, ctx: Any) -> Any:
    """Raw shared memory for ``n`` rows of ``space`` (nested like the space)."""
    raise TypeError(f"space {space} has no shared-memory layout")


@allocate_shared.register(spaces.Box)
@allocate_shared.register(spaces.Discrete)
@allocate_shared.register(spaces.MultiDiscrete)
@allocate_shared.register(spaces.MultiBinary)
def _allocate_array(space: spaces.Space[Any], n: int, ctx: Any) -> Any:
    assert space.dtype is not None and space.shape is not None
    nbytes = n * int(np.prod(space.shape)) * space.dtype.itemsize
    return ctx.RawArray(ctypes.c_uint8, max(1, nbytes))


@allocate_shared.register(spaces.Dict)
def _allocate_dict(space: spaces.Dict, n: int, ctx: Any) -> Any:
    return {key: allocate_shared(sub, n, ctx) for key, sub in space.spaces.items()}


@allocate_shared.register(spaces.Tuple)
def _allocate_tuple(space: spaces.Tuple[Any], n: int, ctx: Any) -> Any:
    return tuple(allocate_shared(sub, n, ctx) for sub in space.spaces)


def view_shared(space: spaces.Space[Any], raw: Any, n: int) -> Any:
    """Numpy arrays over memory from :func:`allocate_shared`, one row per env."""
    if isinstance(space, spaces.Dict):
        return {key: view_shared(sub, raw[key], n) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(view_shared(sub, part, n) for sub, part in zip(space.spaces, raw, strict=True))
    assert space.dtype is not None and space.shape is not None
    count = n * int(np.prod(space.shape))
    array = np.frombuffer(raw, dtype=space.dtype, count=count)
    return array.reshape((n, *space.shape))


# ---------------------------------------------------------------------------------------------
# Whole-batch helpers used by the pool.


def take(space: spaces.Space[Any], batch: Any, ids: np.ndarray | None) -> Any:
    """Copy the rows ``ids`` (all rows when ``None``) of ``batch`` into a new batch."""
    if isinstance(batch, ObjectRows):
        rows = list(batch) if ids is None else [batch[i] for i in ids]
        out: Any = create_empty_array(space, len(rows), fn=np.zeros)
        return concatenate(space, rows, out)
    if isinstance(space, spaces.Dict):
        return {key: take(sub, batch[key], ids) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(take(sub, part, ids) for sub, part in zip(space.spaces, batch, strict=True))
    return batch.copy() if ids is None else batch[ids]


def view_rows(space: spaces.Space[Any], batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of an array-space ``batch`` as views of it, not copies."""
    if isinstance(space, spaces.Dict):
        return {key: view_rows(sub, batch[key], start, stop) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(
            view_rows(sub, part, start, stop) for sub, part in zip(space.spaces, batch, strict=True)
        )
    return batch[start:stop]


def put(space: spaces.Space[Any], batch: Any, ids: slice | np.ndarray | None, values: Any) -> None:
    """Write a batch of ``values`` into rows ``ids`` (all rows when ``None``) of ``batch``."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            put(sub, batch[key], ids, values[key])
    elif isinstance(space, spaces.Tuple):
        for sub, part, value in zip(space.spaces, batch, values, strict=True):
            put(sub, part, ids, value)
    elif ids is None:
        batch[...] = values
    else:
        batch[ids] = values


def allocate_local(space: spaces.Space[Any], n: int) -> Any:
    """A batch for ``n`` envs in this process's memory."""
    if is_array_space(space):
        return create_empty_array(space, n, fn=np.zeros)
    return ObjectRows([None] * n)


@dataclass
class Batch:
    """The arrays one step of the pool fills: row ``i`` belongs to env ``i``; and the infos a
    transport delivers as columns (:func:`~envfleet.info_columns.info_columns`), until handed
    out."""

    observations: Any
    actions: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: InfoTable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.infos = InfoTable(len(self.rewards))

    @classmethod
    def local(cls, obs_space: spaces.Space[Any], act_space: spaces.Space[Any], n: int) -> Batch:
        """Allocate every field in this process's memory."""
        return cls(
            observations=allocate_local(obs_space, n),
            actions=allocate_local(act_space, n),
            rewards=np.zeros(n, dtype=np.float64),
            terminations=np.zeros(n, dtype=np.bool_),
            truncations=np.zeros(n, dtype=np.bool_),
        )


_FLAGS: spaces.Space[Any] = spaces.Box(0, 1, shape=(), dtype=np.bool_)
_REWARDS = spaces.Box(-np.inf, np.inf, shape=(), dtype=np.float64)


class RawAllocator(Protocol):
    """What :meth:`SharedBatch.allocate` takes memory from: a multiprocessing context or another
    allocator of raw bytes (``ctypes.c_uint8`` arrays or any buffer of that many bytes)."""

    def RawArray(self, typecode_or_type: Any, size_or_initializer: int) -> Any: ...


@dataclass
class SharedBatch:
    """Shared-memory handles for a :class:`Batch`, passed to worker processes at start.

    The memory comes from ``multiprocessing``'s heap: its backing file is unlinked as soon as it
    is created, so nothing is left in ``/dev/shm`` whatever way the processes end.
    """

    obs_space: spaces.Space[Any]
    act_space: spaces.Space[Any]
    n: int
    observations: Any  # None when observations travel pickled
    actions: Any  # None when actions travel pickled
    rewards: Any
    terminations: Any
    truncations: Any

    @classmethod
    def allocate(
        cls,
        obs_space: spaces.Space[Any],
        act_space: spaces.Space[Any],
        n: int,
        ctx: multiprocessing.context.BaseContext | RawAllocator,
    ) -> SharedBatch:
        """Allocate every array-like field in shared memory (``ctx.RawArray`` gives the bytes)."""

        def shared(space: spaces.Space[Any]) -> Any:
            return allocate_shared(space, n, ctx) if is_array_space(space) else None

        return cls(
            obs_space,
            act_space,
            n,
            shared(obs_space),
            shared(act_space),
            shared(_REWARDS),
            shared(_FLAGS),
            shared(_FLAGS),
        )

    @staticmethod
    def nbytes(obs_space: spaces.Space[Any], act_space: spaces.Space[Any], n: int) -> int:
        """Bytes of shared memory :meth:`allocate` takes for ``n`` envs."""

        def size(space: spaces.Space[Any]) -> int:
            if isinstance(space, spaces.Dict):
                return sum(size(sub) for sub in space.spaces.values())
            if isinstance(space, spaces.Tuple):
                return sum(size(sub) for sub in space.spaces)
            assert space.dtype is not None and space.shape is not None
            return n * int(np.prod(space.shape)) * space.dtype.itemsize

        spaces_ = (obs_space, act_space, _REWARDS, _FLAGS, _FLAGS)
        return sum(size(space) for space in spaces_ if is_array_space(space))

    def views(self) -> Batch:
        """Numpy views of the shared memory (local lists for the pickled fields)."""

        def view(space: spaces.Space[Any], shm: Any) -> Any:
            if shm is None:
                return ObjectRows([None] * self.n)
            return view_shared(space, shm, self.n)

        return Batch(
            observations=view(self.obs_space, self.observations),
            actions=view(self.act_space, self.actions),
            rewards=view(_REWARDS, self.rewards),
            terminations=view(_FLAGS, self.terminations),
            truncations=view(_FLAGS, self.truncations),
        )


def rows(batch: Any, ids: Sequence[int]) -> dict[int, Any]:
    """The entries ``ids`` of a pickled-path batch, to send back to the parent."""
    return {i: batch[i] for i in ids}


__all__ = [
    "Batch",
    "ObjectRows",
    "RawAllocator",
    "SharedBatch",
    "allocate_local",
    "allocate_shared",
    "fits_dtype",
    "is_array_space",
    "put",
    "rows",
    "take",
    "view_rows",
    "view_shared",
]
