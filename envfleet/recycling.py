"""Large arrays whose memory is used again once nothing holds them.

A rollout's arrays are large (Pong frames: 113 KB an env-step, tens of MB a rollout) and made
afresh for each rollout. Fresh memory costs the pool's process as much as filling it: the
kernel zeroes each page as it is first touched, and a transport that reads a part straight into
its columns pays those faults inside its socket reads. Measured on node sub-pools (Pong frames
as float32, 2 x 4 envs, 50 steps a rollout), fresh arrays cost the driver about 60 µs of CPU an
env-step of its 150.

:class:`Recycler` hands out arrays whose memory returns to it when the last array, view or
tensor over it is gone (a finalizer on the one array all views lead back to: NumPy's views keep
their base alive, ``torch.from_numpy`` keeps its array alive). Nothing changes for a caller who
keeps a rollout: its memory is simply not reused while it is held. Up to ``keep`` free blocks
of each size are kept, and none after :meth:`clear`. Each has an owner it goes with: the pool
(its rollouts' arrays, cleared at its close), a worker's group (what it records), a reply
pipe's reader (large replies).
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

LEAST = 1 << 20
"""Arrays smaller than this are plain ``np.empty`` (their pages are cheap and few)."""


class Recycler:
    """Arrays from memory used again (see the module docstring).

    Args:
        keep: free blocks kept per size.
        least: the bytes below which an array is not recycled.
    """

    def __init__(self, keep: int = 2, least: int = LEAST) -> None:
        self._keep = keep
        self._least = least
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self._open = True

    def empty(self, shape: int | Sequence[int], dtype: Any = np.float64) -> np.ndarray:
        """An uninitialised array, as ``np.empty(shape, dtype)``."""
        dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(map(int, shape))
        kind = np.dtype(dtype)
        count = math.prod(dims)
        nbytes = count * kind.itemsize
        if nbytes < self._least or kind.hasobject:
            return np.empty(dims, dtype=kind)
        with self._lock:
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
        if block is None:
            block = mmap.mmap(-1, nbytes)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer faults on first touch, where allowed
                block.madvise(mmap.MADV_HUGEPAGE)
        flat = np.frombuffer(block, dtype=kind, count=count)  # every view's base
        weakref.finalize(flat, self._give_back, block)
        return flat.reshape(dims)

    def _give_back(self, block: mmap.mmap) -> None:
        with self._lock:
            if not self._open:
                return
            blocks = self._free.setdefault(len(block), [])
            if len(blocks) < self._keep:
                blocks.append(block)

    def free_bytes(self) -> int:
        """The bytes of the free blocks kept."""
        with self._lock:
            return sum(len(b) for blocks in self._free.values() for b in blocks)

    def clear(self) -> None:
        """Keep no free block from now on (the pool closed)."""
        with self._lock:
            self._open = False
            self._free.clear()


__all__ = ["LEAST", "Recycler"]
