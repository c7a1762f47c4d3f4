"""Throughput of envfleet against the baselines, side by side in one run.

Runners (random actions, after warm-up, median of the timed windows; the windows of the runners
are interleaved, so that load from elsewhere on the machine hits them alike):

- ``for-loop``: a Python for-loop over ``gymnasium.make`` envs in this process;
- ``ceiling``: the envs split over one process per usable core that never communicate, their
  throughputs summed: what parallel stepping could reach with no coordination at all;
- ``gym-sync`` / ``gym-async``: Gymnasium's ``SyncVectorEnv`` and
  ``AsyncVectorEnv(shared_memory=True)``;
- ``envfleet-serial`` / ``envfleet-process``: ``envfleet.make`` with each backend.

Workloads: CartPole-v1 x 64, ALE/Pong-v5 x 8, and :class:`bench.envs.SleepEnv` (1 ms sleep per
step) x 32. Prints a table per workload and writes every number, with machine info, to JSON.

Usage::

    python bench/throughput.py                        # everything, about 5 minutes on 2 cores
    python bench/throughput.py --quick                # smoke run: 1 window of 1 s
    python -m bench.throughput --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import traceback
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.envs import WORKLOADS, Workload
from bench.runners import RUNNERS, RunResult, Timing, measure, usable_cores

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "throughput.json"
REFERENCE = "for-loop"
CEILING = "ceiling"
SUBJECT = "envfleet-process"


def _names(value: str, known: dict[str, Any], what: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown}: choose from {', '.join(known)}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads",
        type=lambda v: _names(v, WORKLOADS, "workloads"),
        default=list(WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--runners",
        type=lambda v: _names(v, RUNNERS, "runners"),
        default=list(RUNNERS),
        help=f"comma-separated, from {','.join(RUNNERS)} (default: all)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows (default 3)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default 0.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 window of 1 s")
    return parser.parse_args(argv)


def timing_from(args: argparse.Namespace) -> Timing:
    seconds, repeats, warmup = (1.0, 1, 0.2) if args.quick else (3.0, 3, 0.5)
    return Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=args.warmup if args.warmup is not None else warmup,
        seed=args.seed,
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "usable_cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            p: _version(p) for p in ("envfleet", "gymnasium", "ale-py", "numpy", "cloudpickle")
        },
        "load_average_at_start": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_workload(
    workload: Workload, runners: list[str], timing: Timing, console: Console
) -> dict[str, Any]:
    def report_failure(name: str, exc: BaseException) -> None:
        console.print(f"[red]{workload.name}: {name} failed[/red]")
        console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)

    with console.status(f"{workload.name}: {', '.join(runners)} ..."):
        results = measure(runners, workload, timing, on_error=report_failure)

    def median(name: str) -> float | None:
        result = results.get(name)
        return result.median if isinstance(result, RunResult) else None

    reference, ceiling = median(REFERENCE), median(CEILING)
    table = Table(
        title=f"{workload.label} x {workload.num_envs} "
        f"({timing.repeats} x {timing.seconds:g} s, median)",
        title_justify="left",
    )
    table.add_column("runner", no_wrap=True)
    table.add_column("steps/s", justify="right")
    table.add_column("vs for-loop", justify="right")
    table.add_column("vs ceiling", justify="right")
    table.add_column("setup s", justify="right")
    table.add_column("windows (steps/s)", justify="right")
    table.add_column("other load", justify="right")
    out: dict[str, Any] = {}
    for name, result in results.items():
        if isinstance(result, str):
            table.add_row(name, "[red]failed[/red]", "-", "-", "-", result[:60], "-")
            out[name] = {"error": result}
            continue
        to_reference, to_ceiling = _ratio(result.median, reference), _ratio(result.median, ceiling)
        table.add_row(
            name,
            f"{result.median:,.0f}",
            _fmt_ratio(to_reference),
            _fmt_ratio(to_ceiling),
            f"{result.setup_s:.2f}",
            " ".join(f"{t:,.0f}" for t in result.throughputs),
            " ".join(f"{c:.2f}" for c in result.other_load),
        )
        out[name] = {
            "steps_per_s": result.median,
            "windows": result.throughputs,
            "setup_s": result.setup_s,
            "other_load_cores": result.other_load,
            "ratio_to_for_loop": to_reference,
            "ratio_to_ceiling": to_ceiling,
            **result.info,
        }
    console.print(table)
    loads = [c for r in results.values() if isinstance(r, RunResult) for c in r.other_load]
    if loads and max(loads) > 0.1:
        console.print(
            f"[yellow]other processes kept up to {max(loads):.2f} cores busy during the windows "
            "(column 'other load'): these numbers are skewed[/yellow]"
        )

    subject = _ratio(median(SUBJECT), ceiling)
    meets = None if subject is None or workload.target is None else subject >= workload.target
    if subject is not None:
        target = "no target" if workload.target is None else f"target >= {workload.target:.2f}"
        verdict = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[meets]
        console.print(
            f"[bold]{workload.name}: envfleet process / ceiling = {subject:.2f}[/bold] "
            f"({target}){verdict}\n"
        )
    return {
        "env": workload.label,
        "num_envs": workload.num_envs,
        "target_process_over_ceiling": workload.target,
        "envfleet_process_over_ceiling": subject,
        "meets_target": meets,
        "runners": out,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    timing = timing_from(args)
    console = Console(width=max(Console().width, 120))  # wide enough when piped, too
    machine = machine_info()
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, "
        f"Python {machine['python']}, "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    load = machine["load_average_at_start"][0]
    if load > 0.5:
        console.print(f"[yellow]load average {load:.2f}: other work may skew the numbers[/yellow]")
    report: dict[str, Any] = {
        "machine": machine,
        "timing": {
            "seconds": timing.seconds,
            "repeats": timing.repeats,
            "warmup": timing.warmup,
            "rewarm": timing.rewarm,
            "interleaved": True,
            "seed": timing.seed,
            "action_batches": timing.action_batches,
            "statistic": "median",
            "unit": "env-steps per second",
        },
        "workloads": {},
    }
    for name in args.workloads:
        report["workloads"][name] = run_workload(WORKLOADS[name], args.runners, timing, console)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
