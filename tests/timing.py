"""Bounds on wall-clock waits derived from what things cost on this machine, now.

A test that checks that something finishes "soon" (a budget held, a failure surfacing, a close
escalating) must not assume a quiet machine: under load, starting and closing a pool can take
several times what it takes alone. :func:`pool_cost` measures that cost in the test run itself
and :func:`bound` keeps the fixed bound a quiet machine meets, widened when the measured cost
says the machine is busy.
"""

from __future__ import annotations

import math
import time

import numpy as np

import envfleet
from tests.envs import FaultyEnv

REMEASURE_AFTER = 30.0
"""Seconds a measurement stands for (measuring starts a pool: not before every wait)."""

_measured: dict[str, tuple[float, float]] = {}  # backend: (when, the largest cost seen)


def _measure(backend: str) -> float:
    started = time.perf_counter()
    with envfleet.make(FaultyEnv, 2, backend=backend, num_workers=2, seed=0) as pool:
        pool.reset()
        pool.step(np.ones(2, dtype=np.int64))
    return time.perf_counter() - started


def pool_cost(backend: str = "process") -> float:
    """Seconds to make, reset, step and close a two-worker pool of ``backend`` now: measured at
    most every :data:`REMEASURE_AFTER` seconds, and never less than the run's largest so far
    (load comes and goes)."""
    now = time.monotonic()
    when, cost = _measured.get(backend, (-math.inf, 0.0))
    if now - when > REMEASURE_AFTER:
        cost = max(cost, _measure(backend))
        _measured[backend] = (now, cost)
    return cost


def bound(quiet: float, pools: float, backend: str = "process") -> float:
    """``quiet`` seconds (enough on a quiet machine), or ``pools`` times what a pool's life
    costs now, whichever is longer."""
    return max(quiet, pools * pool_cost(backend))
