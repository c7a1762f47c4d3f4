"""The fixed cost of one synchronous step: envfleet's process backend against the bare pool.

A no-op env (:class:`bench.envs.NoOpEnv`) on 2 worker processes, with 2 and with 64 envs,
against the bare pool (:mod:`envfleet.benchmark.bare`) on as many workers; their windows
interleaved, the medians printed as microseconds per vector step, and their ratio paired by
round (the median of the per-round ratios: :meth:`envfleet.benchmark.RunResult.over`).

Usage::

    python bench/step_cost.py                      # 2 and 64 envs, 3 x 2 s windows each
    python bench/step_cost.py --num-envs 2 --seconds 1 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import functools
import statistics
from typing import Any

from bench.common import RESULTS, int_list, measured, print_machine, progress, save_json, session
from bench.envs import NoOpEnv
from envfleet import benchmark

DEFAULT_JSON = RESULTS / "step_cost.json"
TARGET = 1.3  # envfleet process / bare pool, per step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-envs", type=int_list, default=[2, 64])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="windows (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 window of 0.3 s")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    seconds, repeats = (0.3, 1) if args.quick else (2.0, 3)
    timing = benchmark.Timing.scaled(args.seconds or seconds, args.repeats or repeats)
    openers = {
        "process": benchmark.envfleet_opener("process", num_workers=args.workers),
        benchmark.BARE_POOL: functools.partial(benchmark.open_bare_pool, num_workers=args.workers),
    }
    with session(args.json) as console:
        machine = print_machine(console)
        rows = {n: measure(n, args.workers, openers, timing, console) for n in args.num_envs}
    document = {"machine": machine, "timing": timing.as_dict(), "workers": args.workers}
    save_json(args.json, {**document, "rows": rows})
    return 0


def measure(n: int, workers: int, openers: Any, timing: Any, console: Any) -> dict[str, Any]:
    """envfleet process and the bare pool on ``n`` no-op envs: µs per vector step, ratio."""
    with progress(console, f"no-op x {n}") as hooks:
        got = measured(openers, benchmark.Workload.of(NoOpEnv, n), timing, **hooks)
    us = {name: [1e6 * n / rate for rate in r.throughputs] for name, r in got.items()}
    medians = {name: statistics.median(v) for name, v in us.items()}  # µs per vector step
    ratio = got[benchmark.BARE_POOL].over(got["process"])  # time per step, paired by round
    console.print(
        f"no-op x {n} on {workers} workers: envfleet process {medians['process']:.1f} µs, "
        f"bare pool {medians[benchmark.BARE_POOL]:.1f} µs per step; "
        f"ratio {ratio:.2f} (paired by round; target <= {TARGET}); windows "
        + ", ".join(f"{name} {[round(x, 1) for x in v]}" for name, v in us.items()),
        markup=False,
    )
    return {"us_per_step": us, "median_us": medians, "process_over_bare_pool": ratio}


if __name__ == "__main__":
    sys.exit(main())
