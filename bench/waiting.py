"""How should the process backend wait: block in the kernel at once, or spin first?

The same pools side by side in one run (windows interleaved, the median reported) with
``SPIN_SECONDS`` (both the parent's wait for replies and the workers' wait for commands) set to
0, 20 µs, 200 µs and 2 ms; steps/s and the ratio to blocking at once. Each worker sets its own
``SPIN_SECONDS`` while it builds its envs (before its loop reads it), under any start method,
and the script checks that every worker holds the setting of its row; the parent's is set
around each window.

    python bench/waiting.py [--seconds 3] [--repeats 3] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib
import functools
import multiprocessing
from collections.abc import Iterator
from typing import Any

import gymnasium

import envfleet
from bench.common import (
    RESULTS,
    Case,
    Versus,
    measure_table,
    print_machine,
    save_json,
    script_parser,
    session,
    timing_from,
)
from envfleet.backends import process
from envfleet.benchmark import Runner, Timing, Workload, open_vector
from envfleet.spec import EnvSpec

SPINS = (0.0, 20e-6, 200e-6, 2e-3)
WORKLOADS = (("CartPole-v1", 64, 2), ("ALE/Pong-v5", 8, 2))


@contextlib.contextmanager
def spinning(spin: float) -> Iterator[None]:
    process.SPIN_SECONDS = spin
    try:
        yield
    finally:
        process.SPIN_SECONDS = 0.0


class SpinSetting(gymnasium.Wrapper[Any, Any, Any, Any]):
    """The env, built in a worker after setting that worker's ``SPIN_SECONDS`` (its command
    loop reads it once the envs are built); :attr:`worker_spin_seconds` reads it back."""

    def __init__(self, spec: EnvSpec, spin: float) -> None:
        if multiprocessing.parent_process() is not None:  # a worker, not make()'s probe here
            process.SPIN_SECONDS = spin
        super().__init__(spec.build())

    @property
    def worker_spin_seconds(self) -> float:
        return process.SPIN_SECONDS


def open_spinning(spin: float, workers: int, workload: Workload, timing: Timing) -> Runner:
    """A process-backend pool whose parent and workers spin ``spin`` seconds before blocking."""
    factory = functools.partial(SpinSetting, workload.spec, spin)

    def build() -> envfleet.Pool:
        pool = envfleet.make(factory, workload.num_envs, backend="process", num_workers=workers)
        held = set(pool.get_attr("worker_spin_seconds"))
        if held != {spin}:
            pool.close()
            raise RuntimeError(f"the workers hold SPIN_SECONDS {held}, not {spin}")
        return pool

    inner = open_vector(f"spin {spin * 1e6:g} µs", build, timing)
    window = inner.window
    inner.window = lambda seconds: _spun(spin, window, seconds)  # type: ignore[method-assign]
    return inner


def _spun(spin: float, window: Any, seconds: float) -> float:
    with spinning(spin):
        return float(window(seconds))


def main(argv: list[str] | None = None) -> int:
    args = script_parser(__doc__ or "", RESULTS / "waiting.json").parse_args(argv)
    timing = timing_from(args)
    with session(args.json) as console:
        report: dict[str, Any] = {"machine": print_machine(console), "timing": timing.as_dict()}
        for env_id, num_envs, workers in WORKLOADS:
            cases = [
                Case(f"spin {s * 1e6:g} µs", functools.partial(open_spinning, s, workers), True)
                for s in SPINS
            ]
            title = f"{env_id}, {num_envs} envs, {workers} workers"
            columns = [Versus("vs blocking", cases[0].name)]
            workload = Workload.of(env_id, num_envs)
            report[env_id] = measure_table(console, title, cases, workload, timing, columns)[1]
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
