"""A rollout's part recorded where the pool will read it: its columns in the pool's shared memory.

A rollout's arrays are made when its parts are sent (:class:`~envfleet.rollouts.Out`), in one
block of the pool's memory; on one machine that block is shared (a memfd:
:class:`~envfleet.recycling.Recycler` with ``shared=True``). The process backend then names a
part's columns in its worker's :class:`~envfleet.protocol.Sample` (:class:`RecordRef`: the
block, and where each recorded field's columns lie in it), and the worker records each step
straight there (:func:`envfleet.rollout_loop.sample`). Its reply carries none of the recorded
arrays (``Sampled.in_place``): no pipe carries them and the pool copies no observation::

    pool: Out in a shared block ── Sample(record=RecordRef(pid, fd, inode, fields)) ──► worker
    worker: maps the block (/proc/<pid>/fd/<fd>, kept for the next rollouts), records into
            the columns, replies with the part's other values only (in_place)

A node's agent does the same for its own workers (blocks of its own shared memory), and sends
each part from its block. Where a block cannot be named (private memory: a rollout smaller than
the recycler's least, or past its most shared blocks) or mapped (another user, no ``/proc``), the
part goes down the worker's pipe.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from envfleet.recycling import locate, map_peer

__all__ = ["MAPPED_MOST", "RecordRef", "record_ref", "recorded_views"]

MAPPED_MOST = 6
"""The blocks a worker keeps mapped for the rollouts to come: its pool gives each worker's parts
the same few again (the one recorded, one queued behind, one handed over; ``Recycler``'s
``hint``); mapping a block anew costs a page fault for each of its pages."""

Leaf = tuple[int, tuple[int, ...], tuple[int, ...], str]
"""Where one array lies in a block: its offset, shape, strides and dtype."""


@dataclass(frozen=True)
class RecordRef:
    """Where a part's recorded arrays go: a block of the pool's shared memory, and each array
    (observations' leaves, actions' leaves, rewards, terminations, truncations, in order)."""

    pid: int
    fd: int
    ino: int
    size: int
    leaves: tuple[Leaf, ...]


def record_ref(arrays: list[np.ndarray]) -> RecordRef | None:
    """``arrays`` named in the one shared block they lie in; ``None`` where they are not all in
    one (private memory)."""
    where = locate(arrays[0]) if arrays else None
    if where is None:
        return None
    block, start = where[0], where[0].address
    offsets = []
    for array in arrays:  # each in the first one's block, all of it
        low, high = _byte_bounds(array)
        if low < start or high > start + block.size:
            return None
        offsets.append(int(array.__array_interface__["data"][0]) - start)
    leaves = tuple(
        (at, array.shape, array.strides, array.dtype.str)
        for at, array in zip(offsets, arrays, strict=True)
    )
    return RecordRef(os.getpid(), block.fd, block.ino, block.size, leaves)


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """The first byte ``array`` reaches and one past its last, whatever its strides."""
    low = high = int(array.__array_interface__["data"][0])
    if array.size == 0:
        return low, low
    for n, stride in zip(array.shape, array.strides, strict=True):
        low, high = low + min(0, (n - 1) * stride), high + max(0, (n - 1) * stride)
    return low, high + array.itemsize


_MAPPED: OrderedDict[tuple[int, int, int, int], mmap.mmap] = OrderedDict()
"""This worker's mappings of the pool's blocks, the latest used last."""


def recorded_views(ref: RecordRef) -> list[np.ndarray]:
    """The arrays ``ref`` names, as writable views of its block mapped shared.

    Raises:
        OSError: the block cannot be opened or is not (any more) the one named.
    """
    key = (ref.pid, ref.fd, ref.ino, ref.size)
    memory = _MAPPED.get(key)
    if memory is None:
        _forget_closed()
        memory = map_peer(
            ref.pid, ref.fd, ref.size, ino=ref.ino, write=True, what="the pool's block it names"
        )
        _MAPPED[key] = memory
        while len(_MAPPED) > MAPPED_MOST:
            _MAPPED.popitem(last=False)  # unmapped once its arrays are gone
    else:
        _MAPPED.move_to_end(key)
    return [
        np.ndarray(shape, np.dtype(dtype), buffer=memory, offset=offset, strides=strides)
        for offset, shape, strides, dtype in ref.leaves
    ]


def _forget_closed() -> None:
    """Unmap the blocks their pool has closed since (a mapping would keep their memory)."""
    for key in list(_MAPPED):
        pid, fd, ino, _ = key
        try:
            gone = os.stat(f"/proc/{pid}/fd/{fd}").st_ino != ino
        except OSError:
            gone = True
        if gone:
            del _MAPPED[key]
