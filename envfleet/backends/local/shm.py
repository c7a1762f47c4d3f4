"""Where the process backend's batch memory comes from: ``/dev/shm``, or memfd when it is full.

``multiprocessing`` puts its shared memory in a file of ``/dev/shm`` when that has room, and
silently in a file of the temp dir otherwise: on disk, where the kernel writes the batch back
while the envs step (Docker gives containers a 64 MB ``/dev/shm``, less than an Atari batch of
a few hundred envs). When ``/dev/shm`` has no room for the batch, the pool takes anonymous
memory (``memfd_create``: shared like ``/dev/shm``, limited by the machine's memory only), as
fast as ``/dev/shm``. Where memfd is missing (not Linux) it warns
once, naming the size and Docker's ``--shm-size``, and goes on with the temp dir.
"""

from __future__ import annotations

import ctypes
import multiprocessing.heap
import multiprocessing.sharedctypes
import multiprocessing.util
import os
import warnings
from typing import Any

SHM_DIR = "/dev/shm"

_warned = False


def free_bytes(directory: str = SHM_DIR) -> int | None:
    """Bytes free in ``directory`` (``None``: no such directory)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class MemfdBuffer:
    """``size`` bytes of anonymous shared memory, as ``multiprocessing.heap.BufferWrapper``
    gives them (a ``multiprocessing`` arena over a memfd: it travels to ``spawn`` and
    ``forkserver`` workers as a duplicated descriptor, and ``fork`` workers inherit it)."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("envfleet-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            arena = multiprocessing.heap.Arena(size, fd)
        except BaseException:
            os.close(fd)
            raise
        multiprocessing.util.Finalize(arena, os.close, (fd,))
        self._state = ((arena, 0, size), size)

    def create_memoryview(self) -> memoryview:
        (arena, start, _), size = self._state
        return memoryview(arena.buffer)[start : start + size]


class MemfdAllocator:
    """``RawArray`` as a ``multiprocessing`` context gives it, in memfd memory."""

    def RawArray(self, typecode_or_type: Any, size_or_initializer: int) -> Any:
        assert typecode_or_type is ctypes.c_uint8 and isinstance(size_or_initializer, int)
        return multiprocessing.sharedctypes.rebuild_ctype(  # type: ignore[attr-defined]
            ctypes.c_uint8 * size_or_initializer, MemfdBuffer(size_or_initializer), None
        )


def batch_allocator(ctx: Any, nbytes: int) -> Any:
    """``ctx`` (``/dev/shm``) when it has room for ``nbytes`` of batch arrays; otherwise memfd,
    or, without memfd, ``ctx`` after a warning (once per process)."""
    global _warned
    free = free_bytes()
    if free is None or free >= nbytes:  # not Linux's /dev/shm, or room enough
        return ctx
    if hasattr(os, "memfd_create"):
        return MemfdAllocator()
    if not _warned:
        _warned = True
        warnings.warn(
            f"{SHM_DIR} has {_size(free)} free, less than the pool's {_size(nbytes)} of "
            "batch arrays: they go to a file in the temp dir, "
            "on disk, which is slower. Give the machine more shared memory (Docker: "
            "--shm-size, e.g. --shm-size=2g)",
            RuntimeWarning,
            stacklevel=4,
        )
    return ctx


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


__all__ = ["SHM_DIR", "MemfdAllocator", "MemfdBuffer", "batch_allocator", "free_bytes"]
