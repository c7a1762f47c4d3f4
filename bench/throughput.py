"""Throughput of envfleet against the baselines, side by side in one run (a thin caller of
:mod:`envfleet.benchmark`, which ``envfleet bench`` runs too).

Workloads (:data:`bench.envs.TARGETS`), each with a target for envfleet process / ceiling;
envfleet process / bare pool is printed too, and on Pong envfleet process / ale-py's C++
``AtariVectorEnv`` (``ale-vector``). A table per workload; every number, with machine info, in
the JSON.

Usage::

    python bench/throughput.py                        # everything, about 5 minutes on 2 cores
    python bench/throughput.py --quick                # smoke run: 1 window of 0.5 s
    python -m bench.throughput --workloads pong --seconds 5 --repeats 5
    python bench/throughput.py --workloads cartpole-1024,pong-16   # hosted VectorEnvs
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
from typing import Any

from rich.console import Console

from bench.common import (
    RESULTS,
    add_choice,
    measure_table,
    rows,
    script_parser,
    script_run,
    timing_from,
)
from bench.envs import HOSTED, TARGETS, Target
from envfleet import benchmark
from envfleet.benchmark import BARE_POOL, Workload

DEFAULT_JSON = RESULTS / "throughput.json"
DEFAULT_RUNNERS = ["loop", "ceiling", "bare-pool", "gym-sync", "gym-async", "serial", "process"]
DEFAULT_RUNNERS += ["ale-vector"]  # Pong only: left out where it cannot run
HOSTED_RUNNERS = ["vector", "vector-ceiling", "hosted", "process"]
"""For the hosted workloads: the VectorEnv alone, its ceiling, envfleet hosting it, and
envfleet's single-env path."""
SUBJECT = "process"


def _runners(value: str) -> list[str]:
    try:
        return benchmark.parse_runners(value)  # also takes for-loop, envfleet-process, ...
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_workload(
    workload: Target, runners: list[str], timing: benchmark.Timing, console: Console
) -> dict[str, Any]:
    n = workload.num_envs
    report = measure_table(console, workload.name, runners, Workload.of(workload.env, n), timing)
    if "hosted" in runners:
        for reference, label in (
            ("vector-ceiling", "the VectorEnv's ceiling (one per core)"),
            ("vector", "the VectorEnv alone in one process"),
            ("process", "envfleet's single-env path"),
        ):
            ratio = report.ratio("hosted", n, reference)
            if ratio is not None:
                console.print(f"[bold]{workload.name}: hosted / {label} = {ratio:.2f}[/bold]\n")
    ratios = {ref: report.ratio(SUBJECT, n, ref) for ref in ("ceiling", BARE_POOL, "ale-vector")}
    subject, target = ratios["ceiling"], workload.target
    meets = None if subject is None or target is None else subject >= target
    bare = report.ratio(BARE_POOL, n)
    for reference, label, note in (
        ("ceiling", "ceiling", "(no target)" if target is None else f"(target >= {target:.2f})"),
        (
            BARE_POOL,
            "bare pool",
            "(throughput)" + (f"; bare pool / ceiling = {bare:.2f}" if bare else ""),
        ),
        ("ale-vector", "ale-py AtariVectorEnv", "(the same frames and frame skip)"),
    ):
        if ratios[reference] is not None:
            verdict = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}
            shown = f"{workload.name}: envfleet process / {label} = {ratios[reference]:.2f}"
            mark = verdict[meets] if reference == "ceiling" else ""
            console.print(f"[bold]{shown}[/bold] {note}{mark}\n")
    return {
        **rows(report),
        "num_envs": n,
        "target_process_over_ceiling": target,
        "envfleet_process_over_ceiling": subject,
        "envfleet_process_over_bare_pool": ratios[BARE_POOL],
        "envfleet_process_over_ale_vector": ratios["ale-vector"],
        "meets_target": meets,
        **{
            f"hosted_over_{ref.replace('-', '_')}": report.ratio("hosted", n, ref)
            for ref in ("vector-ceiling", "vector", "process")
            if "hosted" in runners
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", DEFAULT_JSON)
    add_choice(parser, "--workloads", list(TARGETS))
    parser.add_argument(
        "--runners",
        type=_runners,
        default=None,
        help=f"comma-separated, from {','.join(benchmark.RUNNERS)} (default: "
        f"{','.join(DEFAULT_RUNNERS)}; on {','.join(HOSTED)}: {','.join(HOSTED_RUNNERS)})",
    )
    args = parser.parse_args(argv)
    timing = timing_from(args)
    with script_run(args.json) as (console, report):  # ale-py's banners go to the log
        report["timing"] = timing.as_dict()
        report["workloads"] = {
            name: run_workload(
                TARGETS[name],
                args.runners or (HOSTED_RUNNERS if name in HOSTED else DEFAULT_RUNNERS),
                timing,
                console,
            )
            for name in args.workloads
        }
    return 0


if __name__ == "__main__":
    sys.exit(main())
