"""Async pool: sync ``step`` against EnvPool-style ``send``/``recv`` side by side in one run.

Workloads (each a table; every runner's windows are interleaved with the others', so that load
from elsewhere on the machine hits them alike; the median window is reported):

- ``heavytail``: :class:`bench.envs.HeavyTailEnv` x 32 (per-env seeded: 90% of steps
  sleep 0.2 ms, 10% sleep 5 ms). envfleet thread backend (one thread per env), process backend
  with default settings (``defaults``: only ``batch_size`` given), with 4 workers, and 4
  workers x 8 threads (``threads_per_worker``), each sync and async with ``batch_size`` 16 and
  8; PufferLib's ``Multiprocessing`` (4 workers) alike. Target: async at least 1.5x the sync
  pool of the same layout. ``ideal`` rows step one env alone and scale it: ``32 / mean step
  time`` (what async could reach) and ``32 / mean of the slowest of 32`` (what sync could
  reach).
- ``cartpole``: CartPole-v1 x 64; envfleet process (2 workers), EnvPool and PufferLib
  ``Multiprocessing`` (2 workers), sync and async (batch 32).
- ``pong``: Pong x 8; envfleet (``ALE/Pong-v5``, process with 2 workers and thread backend),
  EnvPool's ``Pong-v5`` (its own preprocessing: 84x84 grey, 4 frames stacked; and configured
  like ``ALE/Pong-v5``: 210x160 RGB, no stack, sticky actions 0.25) and PufferLib
  ``Multiprocessing`` over ``ALE/Pong-v5`` (2 workers); sync and async (batch 4).

A library that is not installed (or fails) shows as a failed row with the reason; the rest run.

Usage::

    python bench/async_bench.py                  # everything: 3 x 3 s windows, about 7 minutes
    python bench/async_bench.py --quick          # smoke run: 1 x 0.5 s window, about 1 minute
    python bench/async_bench.py --workloads heavytail --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from bench.common import (
    RESULTS,
    Case,
    IdealRunner,
    add_choice,
    add_ratios,
    layouts,
    measure_cases,
    median_of,
    own_sync_column,
    print_machine,
    progress,
    ratio,
    results_table,
    save_json,
    script_parser,
    session,
    target,
    timing_from,
    versus,
)
from bench.envs import HeavyTailEnv, expected_step_s
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import Timing, Workload, open_envfleet

ASYNC_TARGET = 1.5


# -- the tables ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One table: an env, how many copies, its cases, and the row the ``vs ref`` column
    divides by (an envfleet sync row)."""

    name: str
    title: str
    env: Any
    num_envs: int
    cases: Callable[[], list[Case]]
    reference: str


def open_envpool_by_batch(workload: Workload, timing: Timing, **kw: Any) -> benchmark.Runner:
    """EnvPool with a thread per usable core (its pool's size otherwise)."""
    return benchmark.open_envpool(workload, timing, num_threads=len(usable_cpus()), **kw)


open_pufferlib_by_batch = benchmark.open_pufferlib


def heavytail_cases() -> list[Case]:
    batches, ef = (16, 8), open_envfleet
    return [
        Case("ideal (32 x 1 env)", IdealRunner),
        Case("for-loop", benchmark.open_loop),
        *layouts("envfleet thread", batches, ef, forks=False, backend="thread"),
        *layouts("envfleet process defaults", batches, ef, forks=True, backend="process"),
        *layouts("envfleet process 4w", batches, ef, forks=True, backend="process", num_workers=4),
        *layouts(
            "envfleet process 4w x8t", batches, ef, forks=True, backend="process",
            num_workers=4, threads_per_worker=8,
        ),
        *layouts(
            "envfleet process 8w x4t", batches, ef, forks=True, backend="process",
            num_workers=8, threads_per_worker=4,
        ),
        *layouts("pufferlib mp 4w", batches, open_pufferlib_by_batch, forks=True, num_workers=4),
    ]  # fmt: skip


def cartpole_cases() -> list[Case]:
    batches = (32,)
    return [
        *layouts(
            "envfleet process 2w", batches, open_envfleet, forks=True, backend="process",
            num_workers=2,
        ),
        *layouts("envpool", batches, open_envpool_by_batch, forks=False, task="CartPole-v1"),
        *layouts("pufferlib mp 2w", batches, open_pufferlib_by_batch, forks=True, num_workers=2),
    ]  # fmt: skip


ENVPOOL_PONG_AS_ALE = {
    "img_height": 210,
    "img_width": 160,
    "gray_scale": False,
    "stack_num": 1,
    "repeat_action_probability": 0.25,
    "noop_max": 1,
    "use_fire_reset": False,
}
"""EnvPool's Pong-v5 configured like Gymnasium's ALE/Pong-v5 (EnvPool still max-pools frames)."""


def pong_cases() -> list[Case]:
    batches, ef = (4,), open_envfleet
    ep = functools.partial(open_envpool_by_batch, task="Pong-v5")
    return [
        *layouts("envfleet process 2w", batches, ef, forks=True, backend="process", num_workers=2),
        *layouts("envfleet thread", batches, ef, forks=False, backend="thread"),
        *layouts("envpool (84x84 grey x4)", batches, ep, forks=False),
        *layouts("envpool (as ALE/Pong-v5)", batches, ep, forks=False, **ENVPOOL_PONG_AS_ALE),
        *layouts("pufferlib mp 2w", batches, open_pufferlib_by_batch, forks=True, num_workers=2),
    ]


SCENARIOS: dict[str, Scenario] = {
    "heavytail": Scenario(
        "heavytail",
        "HeavyTailEnv x 32 (90% 0.2 ms, 10% 5 ms sleep)",
        HeavyTailEnv,
        32,
        heavytail_cases,
        "envfleet process 4w x8t sync",
    ),
    "cartpole": Scenario(
        "cartpole", "CartPole-v1 x 64", "CartPole-v1", 64, cartpole_cases,
        "envfleet process 2w sync",
    ),
    "pong": Scenario(
        "pong",
        "Pong x 8 (envfleet/PufferLib: ALE/Pong-v5; EnvPool: its Pong-v5)",
        "ALE/Pong-v5",
        8,
        pong_cases,
        "envfleet process 2w sync",
    ),
}  # fmt: skip


def run_scenario(scenario: Scenario, timing: Timing, console: Console) -> dict[str, Any]:
    cases = scenario.cases()
    workload = Workload.of(scenario.env, scenario.num_envs)
    with progress(console, f"{scenario.name}: {len(cases)} runners") as hooks:
        results = measure_cases(cases, workload, timing, console, **hooks)
    reference = median_of(results, scenario.reference)
    title = (
        f"{scenario.title} ({timing.repeats} x {timing.seconds:g} s, median; "
        f"ref = {scenario.reference})"
    )
    columns = [own_sync_column(cases, results), versus("vs ref", reference)]
    rows = results_table(console, title, [c.name for c in cases], results, columns)
    add_ratios(rows, "ratio_to_ref", reference)
    verdicts = []
    for case in cases:
        if case.sync_of is None:
            continue
        value = ratio(median_of(results, case.name), median_of(results, case.sync_of))
        rows[case.name]["ratio_to_own_sync"] = value
        if case.name.startswith("envfleet") and scenario.name == "heavytail":
            met = target(console, f"{case.name} / sync", value, ASYNC_TARGET, end="")["met"]
            verdicts.append({"runner": case.name, "async_over_sync": value, "meets_target": met})
    row = results.get("ideal (32 x 1 env)")
    ideal = row.info if isinstance(row, benchmark.RunResult) else {}
    if "ideal_sync_steps_per_s" in ideal:
        console.print(
            f"ideal: async {median_of(results, 'ideal (32 x 1 env)'):,.0f} steps/s (32 / "
            f"{ideal['mean_step_ms']:.3f} ms measured mean step; requested "
            f"{expected_step_s() * 1e3:.3f} ms), sync {ideal['ideal_sync_steps_per_s']:,.0f} "
            "steps/s (32 / mean slowest of 32)"
        )
    console.print()
    return {
        "title": scenario.title,
        "num_envs": scenario.num_envs,
        "reference": scenario.reference,
        "async_target": ASYNC_TARGET if scenario.name == "heavytail" else None,
        "verdicts": verdicts,
        "runners": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", RESULTS / "async_bench.json")
    add_choice(parser, "--workloads", list(SCENARIOS))
    args = parser.parse_args(argv)
    timing = timing_from(args)
    # EnvPool's spaces: "Box low's precision lowered by casting to float32".
    warnings.filterwarnings("ignore", message=".*precision lowered.*")
    with session(args.json, width=140) as console:
        report: dict[str, Any] = {
            "machine": print_machine(console, ("envpool", "pufferlib-core", "pufferlib")),
            "timing": timing.as_dict(),
            "unit": "env-steps per second (Pong: agent steps, 4 frames each)",
            "installs": {"pufferlib": "pufferlib-core with pip install --no-deps (it pins torch)"},
            "workloads": {
                name: run_scenario(SCENARIOS[name], timing, console) for name in args.workloads
            },
        }
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
