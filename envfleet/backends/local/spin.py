"""When the process backend's pool polls for replies without sleeping, and how.

Waiting blocks in ``poll`` so that on a machine with few cores the envs get every cycle; the
pool spins only for :data:`SPIN_LIMIT` at most, and only where that costs nobody a core
(:func:`spin_seconds`). :func:`poll_spinning` is the spin itself: plain polls first, then a
``sched_yield`` after each empty one past :data:`SPIN_YIELDS_AFTER`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from envfleet.backends.local.runnable import Runnable

__all__ = ["SPIN_LIMIT", "SPIN_YIELDS_AFTER", "poll_spinning", "quick", "spin_seconds"]

SPIN_LIMIT = 0.0002
"""The longest the pool polls without sleeping for replies, in two cases only: for the last
replies of a wait once some are in and fewer workers still owe one than the machine has usable
cores (the finished workers' cores are idle), and at the start of a wait when its previous wait
got every reply within this limit (workers that fast lose little to a spin that short). Never on
one core (a node agent's on a 1-CPU node, where it holds the core the workers need) nor while
the machine runs or queues more tasks than the pool's (itself and, of its workers, one per
core) and than its cores
(:class:`~envfleet.backends.local.runnable.Runnable`: the spin would hold a core others wait for).
Each saves the pool a sleep and a wake-up (tens of µs on a virtual machine) on most sync steps
of fast envs (docs/benchmarks.md, "The fixed cost of a step")."""

SPIN_YIELDS_AFTER = 20e-6
"""Past this much of a spin, a poll that finds nothing is followed by ``sched_yield``: the pool
may be woken on the core of a worker it still waits for, and a plain spin would hold that
worker off it while the other core idles (CartPole x 64 on 2 workers: 370 µs a step, against
218 yielding and 287 for the bare pool; by ``bench/spin.py``, a probe now in the git
history). The first 20 µs poll plainly: most quick replies come within them, and a yield is
a system call."""


def quick(seconds: float) -> bool:
    """Whether a wait that got every reply in ``seconds`` was quick enough that the next one
    may spin from its start."""
    return seconds < SPIN_LIMIT


def spin_seconds(
    base: float,
    owing: int | None,
    was_quick: bool,
    cores: int,
    own: int,
    runnable: Runnable,
) -> float:
    """How long to spin before sleeping: :data:`SPIN_LIMIT` when fewer workers than ``cores``
    still owe a reply (``owing``; ``None``: none is in yet, and then only if the last wait was
    ``was_quick``), never on one core nor while the machine runs more than the pool's ``own``
    tasks; else ``base``."""
    idle = owing < cores if owing is not None else was_quick
    if cores > 1 and idle and runnable.only(own, cores):
        return max(base, SPIN_LIMIT)
    return base


def poll_spinning(
    poll: Callable[[int], list[tuple[int, int]]], seconds: float
) -> list[tuple[int, int]]:
    """``poll(0)`` until it returns events or ``seconds`` pass (yielding the core after each
    empty poll past :data:`SPIN_YIELDS_AFTER`); the events, or none."""
    events: list[tuple[int, int]] = []
    now = time.perf_counter()
    spin_until, yield_after = now + seconds, now + SPIN_YIELDS_AFTER
    while not events and now < spin_until:
        events = poll(0)
        now = time.perf_counter()
        if not events and now > yield_after:
            os.sched_yield()
    return events
