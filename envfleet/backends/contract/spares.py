"""Spare observation rows: a sync step's copy made by the workers, handed out as it is.

With ``copy=True`` (the default) a sync ``step`` returns observations the caller owns. For
image observations, copying the whole batch out of shared memory is the pool's largest cost per
step, and it comes while every worker waits for the next actions (800 KB, ~90 µs of the pool's
CPU per Pong x 8 step). Here each worker copies its own rows into a spare block of shared
memory right after writing them (from a hot cache, every worker at once), and the pool hands
that block out as the step's observations: nothing left to copy on the pool's side.

A spare is written again only once nothing refers to it. The pool hands out a view whose base is
the spare's array, and numpy gives every array made from that view (a slice, a reshape, a
transpose; a tensor of ``torch.from_numpy`` or a ``memoryview`` holds the view itself) a
reference to the same base: while any of them lives, the base's reference count says so. A
spare held by the caller is never armed; when every spare is held, the step copies as before.

The rows of record stay where they were (the batch arrays): recovery, restarts, async batches
and partial resets read those, and a step that did not go plainly (a worker lost or restarted,
rows that came pickled) is handed out as a copy of them.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.batch_rows import row_index

SPARES = 2
"""Spare blocks per pool: one the caller holds while the next step fills the other (a loop that
keeps the previous observations until ``step`` returns the next ones holds one)."""

MIN_BYTES = 64 << 10
"""The least batch of observations given spares: below it the pool's copy costs less than the
workers' bookkeeping would."""

MAX_BYTES = 256 << 20
"""The most shared memory all spares of one pool may take."""


def spare_bytes(space: spaces.Space[Any], num_envs: int) -> int:
    """Bytes of one spare block for ``num_envs`` rows of ``space``; 0 when it gets none (not one
    array, or a batch too small or too large to be worth one)."""
    if type(space) is not spaces.Box:  # one array per batch; Dict, Tuple, Graph... copy
        return 0
    assert space.dtype is not None
    nbytes = num_envs * int(np.prod(space.shape)) * space.dtype.itemsize
    if nbytes < MIN_BYTES or SPARES * nbytes > MAX_BYTES:
        return 0
    return nbytes


def allocate(space: spaces.Space[Any], num_envs: int, ctx: Any) -> tuple[Any, ...]:
    """Raw shared memory for the spares of ``space`` (``()``: none): :data:`SPARES` blocks and a
    word saying which one the workers copy into (0: none; ``k + 1``: spare ``k``)."""
    nbytes = spare_bytes(space, num_envs)
    if not nbytes:
        return ()
    blocks = [ctx.RawArray(ctypes.c_uint8, nbytes) for _ in range(SPARES)]
    return (ctx.RawArray(ctypes.c_uint8, 1), *blocks)


def setup(
    space: spaces.Space[Any], num_envs: int, ctx: Any, wanted: int
) -> tuple[tuple[Any, ...], Spares | None, Callable[[], None]]:
    """The raw memory (for the workers), the pool's :class:`Spares` and what spoils them, when
    ``wanted`` (the bytes of every spare) is not 0; ``((), None, nothing)`` otherwise."""
    raw = allocate(space, num_envs, ctx) if wanted else ()
    if not raw:
        return raw, None, nothing
    spares = Spares(space, num_envs, raw)
    return raw, spares, spares.spoil


def _arrays(space: spaces.Space[Any], num_envs: int, raw: Sequence[Any]) -> list[np.ndarray]:
    # np.ndarray over the raw memory (not np.frombuffer(...).reshape): the array is the base of
    # every view made from it, whose references it then counts.
    assert space.shape is not None and space.dtype is not None
    return [np.ndarray((num_envs, *space.shape), space.dtype, buffer=block) for block in raw]


class Spares:
    """The pool's side: which spare is free, armed for the next whole step, or handed out.

    Args:
        space: the single observation space.
        num_envs: rows per block.
        raw: what :func:`allocate` gave (not empty).
    """

    def __init__(self, space: spaces.Space[Any], num_envs: int, raw: Sequence[Any]) -> None:
        self._word = np.ndarray((1,), np.uint8, buffer=raw[0])
        self._arrays = _arrays(space, num_envs, raw[1:])
        self._idle = [self._refs(k) for k in range(len(self._arrays))]  # nobody else's
        self._armed = -1
        self._spoiled = False

    def _refs(self, k: int) -> int:
        return sys.getrefcount(self._arrays[k])

    def arm(self) -> None:
        """Have the workers copy the rows of the next command into a spare nobody holds (none
        when all are held: that step copies)."""
        refs, idle = self._refs, self._idle
        for k in range(len(idle)):
            if refs(k) <= idle[k]:
                self._armed, self._spoiled = k, False
                self._word[0] = k + 1
                return

    def spoil(self) -> None:
        """Rows of the armed step were written on another way than a worker's plain reply."""
        self._spoiled = True

    def disarm(self) -> None:
        """The workers copy nothing more (a no-op when not armed)."""
        if self._armed >= 0:
            self._word[0] = 0
            self._armed = -1

    def hand_out(self) -> np.ndarray | None:
        """The armed spare, every worker's rows in it, as a view for the caller; ``None`` when
        none was armed or it was spoiled (then the caller copies the batch rows)."""
        k = self._armed
        if k < 0:
            return None
        self.disarm()
        if self._spoiled:
            return None
        return self._arrays[k][...]


def nothing() -> None:
    """What spoils a pool's spares when it has none."""


def copier(
    space: spaces.Space[Any],
    num_envs: int,
    env_ids: Sequence[int],
    raw: Sequence[Any],
    home: np.ndarray,
) -> Callable[[], None] | None:
    """The worker's side: what copies, after each command, the rows of a worker's envs
    (``env_ids``, of ``num_envs`` rows of ``space``) in ``home`` (the batch's observations)
    into the spare the pool armed, if any; ``None`` when the pool has no spares (``raw``
    empty)."""
    if not raw:
        return None
    word = np.ndarray((1,), np.uint8, buffer=raw[0])
    arrays = _arrays(space, num_envs, raw[1:])
    rows = row_index(env_ids)
    view = isinstance(rows, slice)  # consecutive rows (a worker's block always is): one view
    source = home[rows]

    def copy() -> None:
        k = int(word[0])
        if k:
            arrays[k - 1][rows] = source if view else home[rows]

    return copy


__all__ = [
    "MAX_BYTES",
    "MIN_BYTES",
    "SPARES",
    "Spares",
    "allocate",
    "copier",
    "nothing",
    "setup",
    "spare_bytes",
]
