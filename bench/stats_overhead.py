"""What collecting ``Pool.stats()`` costs: the same pool stepped with statistics on and off.

CartPole-v1 x 64 on the process backend by default, 20 interleaved windows of 0.5 s per side;
the ``stats off`` pool's windows run with the recording methods of
:class:`envfleet.stats.StatsRecorder` replaced by no-ops (:func:`stats_disabled`). Three
figures, against a vector step with stats off: throughput (``1 - on / off``: on a shared
machine, noise far over 2%), the pool thread's CPU per step in situ (not stretched by other
processes), and the recording calls of a step alone on a bare recorder
(:func:`recording_cost`). Target: under 2%.

    python bench/stats_overhead.py [--seconds 0.5] [--repeats 20] [--num-envs 64] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import envfleet
from bench import common
from bench.common import Case
from envfleet.benchmark import CallRunner, RunResult, Timing, Workload, cycle, sample_actions
from envfleet.stats import StatsRecorder

RECORDING = ("busy", "busy_all", "replied", "replied_all", "ended")
"""The methods of :class:`~envfleet.stats.StatsRecorder` that record."""
TARGET_PERCENT = 2.0
"""The most the statistics may cost, in percent of a vector step."""
SIDES = ("on", "off")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def stats_disabled() -> Iterator[None]:
    """The recording methods replaced by no-ops (on the class: every pool of the process)."""
    saved = {name: StatsRecorder.__dict__[name] for name in RECORDING}
    for name in RECORDING:
        setattr(StatsRecorder, name, _nothing)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(StatsRecorder, name, method)


class StatsRunner(CallRunner):
    """A pool stepped whole, its statistics recorded or not (:func:`stats_disabled` around each
    window); each window also adds the CPU µs this thread (the pool's) spent per vector step."""

    def __init__(self, recording: bool, workload: Workload, timing: Timing, **make: Any) -> None:
        self.recording, self.steps = recording, 0
        self.pool = envfleet.make(workload.spec, workload.num_envs, seed=timing.seed, **make)
        self.pool.reset(seed=timing.seed)
        actions = sample_actions(self.pool.single_action_space, workload.num_envs, timing)
        step = cycle(self.pool.step, actions, workload.num_envs)

        def advance() -> int:
            self.steps += 1
            return int(step())

        name = f"stats {'on' if recording else 'off'}"
        workers = self.pool.num_workers
        super().__init__(name, advance, self.pool.close, timing, workers=workers, cpu_us=[])

    def window(self, seconds: float) -> float:
        with contextlib.nullcontext() if self.recording else stats_disabled():
            cpu, steps = time.thread_time(), self.steps
            rate = super().window(seconds)
            self.info["cpu_us"].append(1e6 * (time.thread_time() - cpu) / (self.steps - steps))
        return rate


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
    parser.add_argument("--backend", default="process")
    parser.add_argument("--num-workers", type=int, default=None, help="default: usable cores")
    args = parser.parse_args(argv)
    timing, n = common.timing_from(args, full=(0.5, 20)), args.num_envs
    make = {"backend": args.backend, "num_workers": args.num_workers}
    cases = [Case(f"stats {s}", functools.partial(StatsRunner, s == "on", **make)) for s in SIDES]
    with common.session(args.json) as console:
        machine = common.print_machine(console)
        title = f"{args.env} x {n}, {args.backend} backend: statistics on and off"
        report = common.measure_table(
            console, title, cases, Workload.of(args.env, n), timing, "stats off"
        )
        on, off = (report.results[f"stats {s}"][n] for s in SIDES)
        if not isinstance(on, RunResult) or not isinstance(off, RunResult):
            raise SystemExit("a pool failed: no figures")
        step_us = 1e6 * n / off.median  # wall µs per vector step, stats off
        cpu_on, cpu_off = (statistics.median(r.info["cpu_us"]) for r in (on, off))
        alone = 1e6 * recording_cost(n, on.info["workers"])
        figures = {
            "throughput": 100 * (1 - on.median / off.median),
            "pool_cpu_in_situ": 100 * (cpu_on - cpu_off) / step_us,
            "recording_alone": 100 * alone / step_us,
        }
        console.print(
            f"a vector step {step_us:,.0f} µs; the pool thread's CPU per step {cpu_on:.1f} µs "
            f"with stats, {cpu_off:.1f} without; recording alone {alone:.2f} µs\n"
            f"[bold]overhead[/bold] (target under {TARGET_PERCENT:g}%): "
            + ", ".join(f"{k.replace('_', ' ')} {v:+.2f}%" for k, v in figures.items())
        )
    document = {"machine": machine, **common.rows(report), "overhead_percent": figures}
    common.save_json(args.json, {**document, "target_percent": TARGET_PERCENT}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
