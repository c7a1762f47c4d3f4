"""The order a sync step's commands go out in: the workers last seen on another core first.

A write to a pipe wakes its reader with a hint that the writer is about to sleep (Linux's
``WF_SYNC``), and the kernel may then queue the woken worker on the writer's own core, where
it preempts the pool before the pool has written the other workers' commands: those workers
start a whole env step late, on a core that idled meanwhile. Measured on Pong x 8 (2 workers,
~1.5 ms a step, 2 cores), the first write returned only after ~1 ms on 1-13% of steps.

Each worker notes the CPU it is on as it answers (where it then blocks for the next command,
and where it wakes when that core is free), in a shared slot of its own; a sync step writes
first to the workers noted on other cores than the pool's thread, last to those on its core.
A worker that preempts the pool then delays nothing: every command is already out. The same
run with the commands so ordered: late first writes on 0-0.4% of steps, steps ~10% faster
(docs/benchmarks.md, "Waiting strategy"). Nothing is pinned and no policy changes: the order
of the writes is all that moves, and commands to different workers are independent.

Where the CPU cannot be read (no ``sched_getcpu``), the order stays the workers' own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any


def _sched_getcpu() -> Callable[[], int] | None:
    """glibc's (or musl's) ``sched_getcpu``: the caller's CPU, from the vDSO (~0.1 µs)."""
    try:
        function = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError, TypeError):  # not Linux (Windows: no CDLL(None))
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return function


_getcpu = _sched_getcpu()


def current_cpu() -> int:
    """The CPU the calling thread runs on; -1 where that cannot be read."""
    return _getcpu() if _getcpu is not None else -1


def allocate(allocator: Any, workers: int) -> Any:
    """Shared memory for ``workers`` slots (an ``int32`` each), from ``allocator`` (a
    ``multiprocessing`` context, or what :func:`~envfleet.backends.local.shm.batch_allocator`
    gave)."""
    return allocator.RawArray(ctypes.c_uint8, 4 * workers)


def _slots(raw: Any) -> Any:
    """The ``int32`` slots over ``raw`` (both sides read and write them through this)."""
    return (ctypes.c_int32 * (len(raw) // 4)).from_buffer(raw)


class WakeOrder:
    """The pool's side: the order to hand a command to every worker in.

    Args:
        raw: what :func:`allocate` gave (the workers' slots).
        workers: how many workers.
    """

    def __init__(self, raw: Any, workers: int) -> None:
        self._cpus = _slots(raw)
        self._cpus[:] = [-1] * workers
        self._all = range(workers)
        self._last: tuple[int, list[int], list[int]] = (-1, [], [])  # its CPUs, their order

    def order(self) -> Sequence[int]:
        """Every worker once: those last on another CPU than the caller's first, in order, then
        those on the caller's (or every worker in order, when no CPU is known)."""
        mine = current_cpu()
        cpus = self._cpus[:]
        if mine < 0 or mine not in cpus:
            return self._all
        last_mine, last_cpus, order = self._last
        if mine == last_mine and cpus == last_cpus:  # as at the last step: the same order
            return order
        order = [w for w in self._all if cpus[w] != mine]
        order += [w for w in self._all if cpus[w] == mine]
        self._last = mine, cpus, order
        return order


def noter(raw: Any, worker: int) -> Callable[[], None] | None:
    """The worker's side: what notes, as it answers, the CPU it is on in its slot of ``raw``;
    ``None`` where the CPU cannot be read."""
    getcpu = _getcpu
    if getcpu is None or not raw:
        return None
    slot = _slots(raw)

    def note() -> None:
        slot[worker] = getcpu()

    return note


def then(
    first: Callable[[], None] | None, second: Callable[[], None] | None
) -> Callable[[], None] | None:
    """One call doing ``first``, then ``second`` (either may be ``None``)."""
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()

    return both


__all__ = ["WakeOrder", "allocate", "current_cpu", "noter", "then"]
