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
pipe's reader (large replies), a node's agent (what its workers record).

The pool's and a node agent's blocks are shared memory (``shared=True``: memfds, at most
:data:`SHARED_MOST` held, each with its descriptor open): their process workers map them by
``/proc/<pid>/fd`` and record a rollout's parts straight into them
(:mod:`envfleet.shared_records`). A forked child closes the descriptors it inherited.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LEAST = 1 << 20
"""Arrays smaller than this are plain ``np.empty`` (their pages are cheap and few)."""


SHARED_MOST = 32
"""The most blocks of shared memory one :class:`Recycler` holds at once (each keeps a descriptor
open); past it, blocks are private."""


@dataclass(frozen=True)
class SharedBlock:
    """A block of shared memory (a memfd) this process holds: its descriptor, inode and size,
    and where it is mapped here."""

    fd: int
    ino: int
    size: int
    address: int


def locate(array: np.ndarray) -> tuple[SharedBlock, int] | None:
    """The shared block ``array``'s memory lies in, and its first element's offset there; ``None``
    when it is not in one (a private block, or no block of a :class:`Recycler`)."""
    address = int(array.__array_interface__["data"][0])
    for recycler in list(_RECYCLERS):
        for block in recycler.shared_blocks():
            if block.address <= address < block.address + block.size:
                return block, address - block.address
    return None


def map_peer(
    pid: int, fd: int, size: int, *, ino: int | None = None, write: bool, what: str = "the block"
) -> mmap.mmap:
    """Descriptor ``fd`` of process ``pid`` on this machine (a memfd: ``/proc/<pid>/fd``) mapped
    here: shared when ``write`` (what this process writes, the other sees), else copy-on-write.

    Raises:
        OSError: it cannot be opened, or is not a regular file of ``size`` bytes (and inode
            ``ino``): not (any more) ``what`` it was named as.
    """
    path = f"/proc/{pid}/fd/{fd}"
    handle = os.open(path, (os.O_RDWR if write else os.O_RDONLY | os.O_NONBLOCK) | os.O_CLOEXEC)
    try:
        st = os.fstat(handle)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or ino not in (None, st.st_ino):
            raise OSError(f"{path} is not {what}")
        return mmap.mmap(handle, size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY)
    finally:
        os.close(handle)


class Recycler:
    """Arrays from memory used again (see the module docstring).

    Args:
        keep: free blocks kept per size.
        least: the bytes below which an array is not recycled.
        shared: make blocks of shared memory (memfds, where the system has them), which this
            machine's other processes may map by ``/proc/<pid>/fd`` (:func:`locate`): a
            process worker records a rollout's part straight into the pool's arrays.
    """

    def __init__(self, keep: int = 2, least: int | None = None, shared: bool = False) -> None:
        self._keep = keep
        self._least = LEAST if least is None else least
        self._shared = shared and hasattr(os, "memfd_create")
        self._free: dict[int, list[mmap.mmap]] = {}
        self._fds: dict[int, SharedBlock] = {}  # by id of the mmap: its shared blocks
        self._hints: dict[int, Hashable] = {}  # by id of the mmap: whom it was last given to
        self._lock = threading.Lock()
        self._open = True
        if self._shared:
            _RECYCLERS.add(self)

    def empty(
        self, shape: int | Sequence[int], dtype: Any = np.float64, hint: Hashable = None
    ) -> np.ndarray:
        """An uninitialised array, as ``np.empty(shape, dtype)``; ``hint``: whom it is for (a
        free block last given with the same hint is given first: a process worker that records
        into the pool's blocks keeps mapped the few it is given again and again)."""
        dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(map(int, shape))
        kind = np.dtype(dtype)
        count = math.prod(dims)
        nbytes = count * kind.itemsize
        if nbytes < max(self._least, 1) or kind.hasobject:
            return np.empty(dims, dtype=kind)
        with self._lock:  # once on the common path: a free block taken, and its hint noted
            blocks = self._free.get(nbytes)
            block = None
            if blocks:
                hints = self._hints
                mine = [k for k, b in enumerate(blocks) if hints.get(id(b)) == hint]
                block = blocks.pop(mine[-1] if mine else -1)
                hints[id(block)] = hint
        if block is None:
            block = self._new(nbytes)
            with self._lock:
                self._hints[id(block)] = hint
        flat = np.frombuffer(block, dtype=kind, count=count)  # every view's base
        weakref.finalize(flat, self._give_back, block)
        return flat.reshape(dims)

    def _new(self, nbytes: int) -> mmap.mmap:
        """A new block: shared while this recycler holds fewer than :data:`SHARED_MOST`."""
        if self._shared and len(self._fds) < SHARED_MOST:
            with contextlib.suppress(OSError):  # no memory for a memfd: a private block
                fd = os.memfd_create("envfleet-rollout", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, nbytes)
                    block = mmap.mmap(fd, nbytes)
                except BaseException:
                    os.close(fd)
                    raise
                address = np.frombuffer(block, np.uint8).ctypes.data
                with self._lock:
                    self._fds[id(block)] = SharedBlock(fd, os.fstat(fd).st_ino, nbytes, address)
                return block
        block = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer faults on first touch, where allowed
            block.madvise(mmap.MADV_HUGEPAGE)
        return block

    def shared_blocks(self) -> list[SharedBlock]:
        """The shared blocks it holds (handed out or free)."""
        with self._lock:
            return list(self._fds.values())

    def keep_at_least(self, count: int) -> None:
        """Keep at least ``count`` free blocks of each size (one for each of that many users
        that take one, give it back and take one again: a pool's workers' rollout parts)."""
        with self._lock:
            self._keep = max(self._keep, count)

    def _give_back(self, block: mmap.mmap) -> None:
        with self._lock:
            if self._open:
                blocks = self._free.setdefault(len(block), [])
                if len(blocks) < self._keep:
                    blocks.append(block)
                    return
            self._hints.pop(id(block), None)
            shared = self._fds.pop(id(block), None)
        if shared is not None:  # gone with its last array: its descriptor too
            os.close(shared.fd)

    def free_bytes(self) -> int:
        """The bytes of the free blocks kept."""
        with self._lock:
            return sum(len(b) for blocks in self._free.values() for b in blocks)

    def clear(self) -> None:
        """Keep no free block from now on (the pool closed)."""
        with self._lock:
            self._open = False
            free = [block for blocks in self._free.values() for block in blocks]
            self._free.clear()
            self._hints.clear()
            fds = [self._fds.pop(id(block)).fd for block in free if id(block) in self._fds]
        for fd in fds:
            os.close(fd)

    def forked(self) -> None:
        """In a forked child: the shared blocks' descriptors are the parent's (closed here; the
        memory stays mapped while arrays over it live), and no block is kept or made shared."""
        self._lock = threading.Lock()  # another thread of the parent's may have held it
        self._open = self._shared = False
        self._free.clear()
        self._hints.clear()
        fds = [block.fd for block in self._fds.values()]
        self._fds.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


_RECYCLERS: weakref.WeakSet[Recycler] = weakref.WeakSet()
"""The recyclers of shared blocks in this process (:func:`_after_fork`)."""


def _after_fork() -> None:
    for recycler in list(_RECYCLERS):
        recycler.forked()
    _RECYCLERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


__all__ = ["LEAST", "SHARED_MOST", "Recycler", "SharedBlock", "locate", "map_peer"]
