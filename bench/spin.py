"""The process backend's bounded spin on a quiet and on a busy machine: always, gated, never.

One pool of no-op envs (:class:`bench.envs.NoOpEnv`; CartPole or Pong with ``--env``) on 2
workers (``--workers``), and the bare pool on as many beside it, stepped in alternating windows
in this process, with the pool's spin (``SPIN_LIMIT``) taken always (the gate on the machine's
runnable tasks bypassed), gated (the default), gated counting every worker as the pool's own
task (the gate before it counted at most one worker per core: the same on 2 workers), gated
without yielding the core between polls (``SPIN_YIELDS_AFTER`` past the spin: a plain spin),
gated with the workers switched to Linux's ``SCHED_BATCH`` (a woken worker does not preempt the
running task; tried, not adopted: docs/benchmarks.md) and never; ``--busy K`` runs K busy loops
(a learner's threads, another pool) for the whole run. Prints the median µs per vector step and
the pool's CPU per step of each.

Usage::

    python bench/spin.py                   # 2 and 64 envs, quiet
    python bench/spin.py --busy 2          # beside two busy loops
    python bench/spin.py --busy 2 --workers 8 --num-envs 64   # more workers than cores
    python bench/spin.py --env cartpole --num-envs 64
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import itertools
import multiprocessing
import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import envfleet
from bench.common import int_list, timed
from bench.envs import NoOpEnv
from envfleet import benchmark
from envfleet.backends.local import process


def _busy_loop() -> None:
    while True:
        pass


@contextmanager
def busy(loops: int) -> Iterator[None]:
    """``loops`` processes that never sleep, for the duration."""
    procs = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(loops)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def window(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """µs per call of ``step`` and this thread's CPU µs per call, over ``steps`` calls."""
    wall, _, cpu = timed(step, steps)
    return wall / steps * 1e6, cpu / steps * 1e6


ENVS: dict[str, Any] = {"noop": NoOpEnv, "cartpole": "CartPole-v1", "pong": "ALE/Pong-v5"}

Mode = tuple[float, float, Callable[[int, int], bool], int, Callable[[], object]]
"""A mode: its spin limit, when the spin yields, the gate, the workers' policy, the step."""


def measure(env: Any, n: int, windows: int, steps: int, workers: int = 2) -> dict[str, Any]:
    """Median µs (and CPU µs) per step of each spin mode and of the bare pool, ``n`` envs on
    ``workers`` workers."""
    pool = envfleet.make(env, num_envs=n, backend="process", num_workers=workers)
    timing = benchmark.Timing.scaled(1.0, 1)
    bare = benchmark.bare.BarePool(benchmark.Workload.of(env, n), timing, workers)
    try:
        pool.reset(seed=0)
        choices = pool.single_action_space.n  # type: ignore[attr-defined]
        batches = np.random.default_rng(0).integers(0, choices, (64, n))
        actions = iter(itertools.cycle(batches))

        def step() -> None:
            pool.step(next(actions))

        runnable = pool._transport._runnable
        gated, always = runnable.only, lambda tasks, cores: True
        all_workers = lambda tasks, cores: gated(1 + workers, cores)  # noqa: E731 - the gate before: every worker counted
        limit, yields = process.SPIN_LIMIT, process.SPIN_YIELDS_AFTER
        batch, other = os.SCHED_BATCH, os.SCHED_OTHER
        modes: dict[str, Mode] = {
            "always": (limit, yields, always, other, step),
            "gated": (limit, yields, gated, other, step),
            "gated-all-workers": (limit, yields, all_workers, other, step),
            "no-yield": (limit, 1.0, gated, other, step),
            "batch-workers": (limit, 0.0, gated, batch, step),
            "never": (0.0, yields, gated, other, step),
            "bare-pool": (0.0, yields, gated, other, bare.step),
        }
        got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        try:
            for _ in range(windows):
                for mode, (spin, plain, gate, policy, call) in modes.items():
                    process.SPIN_LIMIT, process.SPIN_YIELDS_AFTER = spin, plain
                    runnable.only = gate
                    for pid in pool._transport.pids():
                        os.sched_setscheduler(pid, policy, os.sched_param(0))
                    got[mode].append(window(call, steps))
        finally:
            process.SPIN_LIMIT, process.SPIN_YIELDS_AFTER, runnable.only = limit, yields, gated
    finally:
        pool.close()
        bare.close()
    return {
        mode: {
            "us": statistics.median(us for us, _ in runs),
            "cpu_us": statistics.median(cpu for _, cpu in runs),
            "windows": [round(us, 1) for us, _ in runs],
        }
        for mode, runs in got.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-envs", type=int_list, default=[2, 64])
    parser.add_argument("--env", choices=sorted(ENVS), default="noop")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the run")
    parser.add_argument("--workers", type=int, default=2, help="the pools' workers")
    parser.add_argument("--windows", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3000, help="steps per window")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 window of 300 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.steps = 1, 300
    print(f"load average {os.getloadavg()[0]:.2f}, {args.busy} busy loops")
    with busy(args.busy):
        for n in args.num_envs:
            rows = measure(ENVS[args.env], n, args.windows, args.steps, args.workers)
            print(
                f"{args.env} x {n} on {args.workers} workers: "
                + "; ".join(
                    f"{mode} {row['us']:.1f} us (CPU {row['cpu_us']:.1f})"
                    for mode, row in rows.items()
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
