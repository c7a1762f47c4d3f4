"""Throughput of envfleet against the baselines, side by side in one run (a thin caller of
:mod:`envfleet.benchmark`, which ``envfleet bench`` runs too).

Workloads: CartPole-v1 x 64, ALE/Pong-v5 x 8, and :class:`bench.envs.SleepEnv` (1 ms sleep per
step) x 32; each has a target for envfleet process / ceiling. Beside the ceiling, the *bare
pool* (``bare-pool``: worker processes that read a byte, step their envs, write a byte) is the
least a process pool of envfleet's design can cost; envfleet process / bare pool is printed too,
and on Pong envfleet process / ale-py's C++ ``AtariVectorEnv`` (``ale-vector``: the same raw
frames, frame skip and sticky actions, stepped by C++ threads).
Prints a table per workload and writes every number, with machine info, to JSON.

Usage::

    python bench/throughput.py                        # everything, about 5 minutes on 2 cores
    python bench/throughput.py --quick                # smoke run: 1 window of 0.5 s
    python -m bench.throughput --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import traceback
from typing import Any

from rich.console import Console

from bench.common import (
    RESULTS,
    add_choice,
    print_machine,
    progress,
    save_json,
    script_parser,
    session,
    timing_from,
)
from bench.envs import TARGETS, Target
from envfleet import benchmark

DEFAULT_JSON = RESULTS / "throughput.json"
DEFAULT_RUNNERS = ["loop", "ceiling", "bare-pool", "gym-sync", "gym-async", "serial", "process"]
DEFAULT_RUNNERS += ["ale-vector"]  # Pong only: left out where it cannot run
SUBJECT = "process"


def _runners(value: str) -> list[str]:
    try:
        return benchmark.parse_runners(value)  # also takes for-loop, envfleet-process, ...
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_workload(
    workload: Target, runners: list[str], timing: benchmark.Timing, console: Console
) -> dict[str, Any]:
    def report_failure(name: str, num_envs: int, exc: BaseException) -> None:
        console.print(f"[red]{workload.name}: {name} failed[/red]")
        console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)

    with progress(console, workload.name) as hooks:
        report = benchmark.sweep(
            workload.env, [workload.num_envs], runners, timing, on_error=report_failure, **hooks
        )
    console.print(benchmark.report_table(report))
    for note in benchmark.report_notes(report):
        console.print(f"[yellow]{note}[/yellow]")
    subject = report.ratio(SUBJECT, workload.num_envs)
    meets = None if subject is None or workload.target is None else subject >= workload.target
    if subject is not None:
        target = "no target" if workload.target is None else f"target >= {workload.target:.2f}"
        verdict = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[meets]
        console.print(
            f"[bold]{workload.name}: envfleet process / ceiling = {subject:.2f}[/bold] "
            f"({target}){verdict}\n"
        )
    over_bare = report.ratio(SUBJECT, workload.num_envs, benchmark.BARE_POOL)
    if over_bare is not None:
        bare_ceiling = report.ratio(benchmark.BARE_POOL, workload.num_envs)
        console.print(
            f"[bold]{workload.name}: envfleet process / bare pool = {over_bare:.2f}[/bold] "
            "(throughput)"
            + (f"; bare pool / ceiling = {bare_ceiling:.2f}" if bare_ceiling else "")
            + "\n"
        )
    over_ale = report.ratio(SUBJECT, workload.num_envs, "ale-vector")
    if over_ale is not None:
        console.print(
            f"[bold]{workload.name}: envfleet process / ale-py AtariVectorEnv = "
            f"{over_ale:.2f}[/bold] (the same frames and frame skip)\n"
        )
    document = report.as_dict()
    document.pop("machine")  # once, at the top
    return {
        **document,
        "num_envs": workload.num_envs,
        "target_process_over_ceiling": workload.target,
        "envfleet_process_over_ceiling": subject,
        "envfleet_process_over_bare_pool": over_bare,
        "envfleet_process_over_ale_vector": over_ale,
        "meets_target": meets,
    }


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", DEFAULT_JSON)
    add_choice(parser, "--workloads", list(TARGETS))
    parser.add_argument(
        "--runners",
        type=_runners,
        default=DEFAULT_RUNNERS,
        help=f"comma-separated, from {','.join(benchmark.RUNNERS)}",
    )
    args = parser.parse_args(argv)
    timing = timing_from(args)
    with session(args.json) as console:  # ale-py's banners go to the log, not the screen
        report: dict[str, Any] = {"machine": print_machine(console), "timing": timing.as_dict()}
        report["workloads"] = {
            name: run_workload(TARGETS[name], args.runners, timing, console)
            for name in args.workloads
        }
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
