"""Batch arrays that any process of this machine can map: the Ray backend's same-node path.

The process backend's workers are children of the pool and inherit its shared memory. A Ray
actor is not: Ray starts it. So the pool puts the batch in one anonymous memory file
(``memfd_create``): it has no name in ``/dev/shm`` and is freed with the last process that maps
it, so nothing can leak, whatever way the processes end. An actor on the same machine opens it
through ``/proc/<pool pid>/fd/<fd>`` and checks a random token at its start, so a process of
another machine (the same pid and fd there) can never mistake its own memory for it. Both sides
carve the same arrays from it with :meth:`~envfleet.buffers.SharedBatch.allocate`.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces

from envfleet.buffers import Batch, SharedBatch

_ALIGN = 64
_TOKEN_BYTES = 16


class _Carver:
    """An allocator that hands out consecutive aligned pieces of one buffer (or only counts)."""

    def __init__(self, buffer: memoryview | None) -> None:
        self.buffer = buffer
        self.offset = _ALIGN  # the token lives in the first cache line

    def RawArray(self, typecode_or_type: Any, size_or_initializer: int) -> Any:
        size = max(1, int(size_or_initializer))
        start = self.offset
        self.offset = -(-(start + size) // _ALIGN) * _ALIGN
        return None if self.buffer is None else self.buffer[start : start + size]


def _layout(
    obs_space: spaces.Space[Any], act_space: spaces.Space[Any], n: int, buffer: memoryview | None
) -> tuple[SharedBatch, int]:
    carver = _Carver(buffer)
    shared = SharedBatch.allocate(obs_space, act_space, n, carver)
    return shared, carver.offset


@dataclass(frozen=True)
class NodeMemory:
    """Where the pool's batch memory is, for a process of the same machine to map it."""

    pid: int
    fd: int
    size: int
    token: bytes
    obs_space: spaces.Space[Any]
    act_space: spaces.Space[Any]
    num_envs: int

    def attach(self) -> tuple[Batch, mmap.mmap]:
        """Map the memory here; raise ``OSError`` when it is not this machine's (or not there).

        The map must stay referenced as long as the batch is used.
        """
        fd = os.open(f"/proc/{self.pid}/fd/{self.fd}", os.O_RDWR)
        try:
            memory = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        if memory[:_TOKEN_BYTES] != self.token:
            memory.close()
            raise OSError("the batch memory found is not the pool's (another machine?)")
        shared, _ = _layout(self.obs_space, self.act_space, self.num_envs, memoryview(memory))
        return shared.views(), memory


class PoolMemory:
    """The pool's side: the memory file, its map and the batch carved from it."""

    def __init__(self, obs_space: spaces.Space[Any], act_space: spaces.Space[Any], n: int) -> None:
        _, size = _layout(obs_space, act_space, n, None)
        self._fd = os.memfd_create("envfleet-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._memory = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        # The file closes with this object even if close() is never called.
        self._close_fd = weakref.finalize(self, os.close, self._fd)
        token = secrets.token_bytes(_TOKEN_BYTES)
        self._memory[:_TOKEN_BYTES] = token
        shared, _ = _layout(obs_space, act_space, n, memoryview(self._memory))
        self.batch = shared.views()
        self.where = NodeMemory(os.getpid(), self._fd, size, token, obs_space, act_space, n)

    def close(self) -> None:
        """Close the file: the memory goes once no actor maps it (the batch views stay valid)."""
        self._close_fd()


def available() -> bool:
    """Whether this platform has anonymous memory files (Linux)."""
    return hasattr(os, "memfd_create")


__all__ = ["NodeMemory", "PoolMemory", "available"]
