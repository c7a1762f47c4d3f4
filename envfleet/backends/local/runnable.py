"""Whether this machine has a core to spare right now: the process backend's pool polls for
replies without sleeping (``SPIN_LIMIT``) only then.

A spin pays on an otherwise idle machine: the pool saves a sleep and a wake-up on a core that
would idle anyway. On a busy one (a learner's threads, other pools, a test suite) it holds a
core that the workers it waits for, or anything else, is queued for, and delays the replies it
waits for: measured on 2 cores beside two busy loops, 64 no-op envs took ~1.7 times as long a step
with the spin as without it (docs/benchmarks.md, "Waiting strategy"). Linux counts the tasks
that are running or queued for a core, machine-wide, in ``/proc/loadavg`` (its fourth field,
``running/total``); reading it costs ~1.5 µs, so a spin's check reads it at most once per
:data:`FRESH` (a sync step of fast envs waits every few tens of µs).
"""

from __future__ import annotations

import os
import time

LOADAVG = "/proc/loadavg"

FRESH = 0.001
"""Seconds a count read by :meth:`Runnable.only` stays its answer."""


class Runnable:
    """The machine's count of running and queued tasks, read from :data:`LOADAVG` (kept open)."""

    def __init__(self, path: str = LOADAVG) -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # not Linux, or no /proc: never a reason not to spin
            self._fd = None
        self._read_at = -FRESH  # when only() last read the count, and what it was
        self._last = 0

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
        or every task that does has one of the ``cores`` (by a count at most :data:`FRESH`
        old)."""
        now = time.monotonic()
        if now - self._read_at >= FRESH:
            self._read_at, self._last = now, self.count()
        return self._last <= max(tasks, cores)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["FRESH", "LOADAVG", "Runnable"]
