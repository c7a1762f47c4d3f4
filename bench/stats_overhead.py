"""What recording ``Pool.stats()`` costs: the calls one synchronous vector step makes (``busy``
and ``replied`` per worker, ``ended`` once), timed in a tight loop on a bare
:class:`envfleet.stats.StatsRecorder` of the pool's shape, against the wall time of the step
itself (the process backend's, measured beside it). Target: under 2%. Timed end to end (a pool
with statistics on beside one with them off) the difference drowns in a shared machine's noise;
the recording calls alone do not.

    python bench/stats_overhead.py [--env CartPole-v1] [--num-envs 64] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import time

import numpy as np

from bench import common
from envfleet import benchmark
from envfleet.stats import StatsRecorder

TARGET_PERCENT = 2.0
"""The most the statistics may cost, in percent of a vector step."""


def recording_cost(num_envs: int, num_workers: int, calls: int = 20_000) -> float:
    """Seconds the recording calls of one synchronous vector step take, timed alone."""
    ids = [tuple(int(i) for i in a) for a in np.array_split(np.arange(num_envs), num_workers)]
    recorder = StatsRecorder(ids, num_envs)
    env_ids = np.arange(num_envs)
    done = np.zeros(num_envs, dtype=bool)
    done[::23] = True  # CartPole: an episode ends every ~20 steps per env
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            now = time.monotonic()
            for worker, worker_ids in enumerate(ids):
                recorder.busy(worker, now)
                recorder.replied(worker, now, time.monotonic(), len(worker_ids), True)
            recorder.ended(env_ids, done)
        best = min(best, (time.perf_counter() - start) / calls)
    # The pool reads the clock around the calls whether or not it records: not recording cost.
    start = time.perf_counter()
    for _ in range(calls):
        time.monotonic()
        for _ in ids:
            time.monotonic()
    return max(0.0, best - (time.perf_counter() - start) / calls)


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "stats_overhead.json")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=64)
    args = parser.parse_args(argv)
    timing, n = common.timing_from(args), args.num_envs
    pool = common.Case("process", benchmark.RUNNERS["process"].open, forks=True)
    with common.session(args.json) as console:
        machine = common.print_machine(console)
        workload = benchmark.Workload.of(args.env, n)
        report = common.measure_table(console, f"{args.env} x {n}", [pool], workload, timing)
        result = report.results["process"][n]
        if not isinstance(result, benchmark.RunResult):
            raise SystemExit(f"the pool failed: {result}")
        step_us = 1e6 * n / result.median
        alone_us = 1e6 * recording_cost(n, result.info["workers"])
        percent = 100 * alone_us / step_us
        console.print(
            f"[bold]recording a vector step: {alone_us:.2f} µs of {step_us:,.0f} µs, "
            f"{percent:.2f}%[/bold] (target under {TARGET_PERCENT:g}%)"
        )
    figures = {"recording_us": alone_us, "step_us": step_us, "percent": percent}
    common.save_json(args.json, {"machine": machine, **common.rows(report), **figures}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
