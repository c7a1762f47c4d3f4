"""How the process backend's pool and workers share the machine's cores: whether it has a core
to spare right now (the pool polls for replies without sleeping, ``SPIN_LIMIT``, only then),
and the workers' scheduling policy (:func:`run_as_batch`).

A spin pays on an otherwise idle machine: the pool saves a sleep and a wake-up on a core that
would idle anyway. On a busy one (a learner's threads, other pools, a test suite) it holds a
core that the workers it waits for, or anything else, is queued for, and delays the replies it
waits for: measured on 2 cores beside two busy loops, 64 no-op envs took ~1.7 times as long a step
with the spin as without it (docs/benchmarks.md, "Waiting strategy"). Linux counts the tasks
that are running or queued for a core, machine-wide, in ``/proc/loadavg`` (its fourth field,
``running/total``); reading it costs ~2 µs, once per wait that would spin.
"""

from __future__ import annotations

import os

LOADAVG = "/proc/loadavg"


class Runnable:
    """The machine's count of running and queued tasks, read from :data:`LOADAVG` (kept open)."""

    def __init__(self, path: str = LOADAVG) -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # not Linux, or no /proc: never a reason not to spin
            self._fd = None

    def count(self) -> int:
        """Tasks running or queued for a core now, the caller included (0: unknown)."""
        if self._fd is None:
            return 0
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[3].split(b"/")[0])
        except (OSError, IndexError, ValueError):
            return 0

    def only(self, tasks: int, cores: int) -> bool:
        """Nothing but the caller's ``tasks`` (itself included) runs or queues for a core,
        or every task that does has one of the ``cores``."""
        return self.count() <= max(tasks, cores)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


BATCH_WORKERS = True
"""Worker processes run as batch work (:func:`run_as_batch`)."""


def run_as_batch() -> None:
    """Run the calling process under Linux's ``SCHED_BATCH`` (same priority and nice; nothing
    elsewhere, nor where the kernel refuses): woken, it does not preempt the running task.

    A pool hands a step out one pipe write per worker, and a pipe's wake-up tells the kernel
    that the writer is about to sleep: the woken worker may be queued on the pool's own core
    and preempt the pool there before it has written the other workers' commands, which then
    start a whole env step late (Pong x 8 on 2 workers: ~1 step in 10 took ~1.9 ms instead of
    ~1 ms). sched(7) names the policy for "workloads that want a deterministic scheduling
    policy without interactivity causing extra preemptions (between the workload's tasks)";
    the pool's spin yields the core at each empty poll, so a worker queued behind it waits
    for no more than a poll. The policy is inherited by what the worker starts.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if not BATCH_WORKERS or policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:  # pragma: no cover - a kernel or sandbox that refuses it
        pass


__all__ = ["BATCH_WORKERS", "LOADAVG", "Runnable", "run_as_batch"]
