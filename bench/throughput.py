"""Throughput of envfleet against the baselines, side by side in one run (a thin caller of
:mod:`envfleet.benchmark`, which ``envfleet bench`` runs too).

Workloads (:data:`bench.envs.TARGETS`): each with its runners, the row its ratios are to and a
target. ``cartpole``, ``pong``: against the ceiling; ``sleep``: envs that wait 1 ms, the thread
backend against the for-loop and bare threads; ``heavytail``: async (``batch_size=8``) against
sync; ``cartpole-1024``, ``pong-16``: VectorEnvs hosted by the workers. ``--runners`` takes the
engine's names and envfleet's variants (``process:batch_size=8``,
``thread:cpu_affinity=[1]``: :mod:`envfleet.benchmark.registry`). A table per workload; every
number, with machine info, in the JSON.

Usage::

    python bench/throughput.py --workloads cartpole,pong      # about 5 minutes on 2 cores
    python bench/throughput.py --quick                        # smoke run: 1 window of 0.5 s
    python -m bench.throughput --workloads sleep --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
from typing import Any

from bench import common
from bench.envs import TARGETS
from envfleet import benchmark

OWN = {"bare-threads": common.Case("bare-threads", benchmark.open_bare_threads)}
"""Runners of this script's own, beside the engine's."""


def _runners(value: str) -> list[str]:
    """``--runners``: this script's own, or what the engine takes (aliases, variants)."""
    names: list[str] = []
    for raw in value.split(","):
        try:
            names += [raw.strip()] if raw.strip() in OWN else benchmark.parse_runners(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return list(dict.fromkeys(names))


def run_workload(name: str, runners: list[str], timing: Any, console: Any) -> dict[str, Any]:
    target = TARGETS[name]
    n, reference = target.num_envs, target.reference
    workload = benchmark.Workload.of(target.env, n)
    cases = [OWN.get(runner, runner) for runner in runners]
    report = common.measure_table(console, name, cases, workload, timing, reference)
    check = None
    if target.target is not None:
        subject, least = target.target
        value = report.ratio(subject, n, reference)
        check = common.target(console, f"{name}: {subject} / {reference}", value, least)
    ratios = {r: report.ratio(r, n, reference) for r in runners}
    return {**common.rows(report), "reference": reference, "ratios": ratios, "target": check}


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "throughput.json")
    common.add_choice(parser, "--workloads", list(TARGETS))
    parser.add_argument(
        "--runners",
        type=_runners,
        default=None,
        help=f"comma-separated, from {','.join([*benchmark.RUNNERS, *OWN])} and envfleet's "
        "variants (default: each workload's own)",
    )
    args = parser.parse_args(argv)
    timing = common.timing_from(args)
    with common.script_run(args.json) as (console, report):  # ale-py's banners go to the log
        report["timing"] = timing.as_dict()
        report["workloads"] = {
            name: run_workload(name, args.runners or list(TARGETS[name].runners), timing, console)
            for name in args.workloads
        }
    return 0


if __name__ == "__main__":
    sys.exit(main())
