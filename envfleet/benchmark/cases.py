"""A benchmark script's own rows: named cases measured side by side, shown as one table.

``envfleet bench`` measures the runners of :data:`~envfleet.benchmark.RUNNERS`; a script
(``bench/async_bench.py``, ``bench/thread_bench.py``, ...) adds rows of its own: a layout of
workers, an async batch size, a peer library configured some way. Each is a :class:`Case`, a
name and an opener with the signature of a registered runner's. :func:`measure_cases` times
them with :func:`~envfleet.benchmark.measure` (the same interleaved windows, medians and
other-load readings) and :func:`results_table` prints them with the script's ratio columns.
:func:`script_parser` and :func:`timing_from` give every script the same timing options.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from envfleet.benchmark.base import CallRunner, Runner, RunResult, Timing, Workload
from envfleet.benchmark.measure import measure

Opener = Callable[[Workload, Timing], Runner]


@dataclass(frozen=True)
class Case:
    """One row of a script's table.

    Attributes:
        name: row name (and the runner's name in the results).
        open: builds, resets and warms up the runner on the table's workload.
        forks: the runner starts processes; such runners are opened before those that start
            threads in this process (forking a process full of threads is asking for trouble).
        sync_of: for an async row, the name of the sync row with the same layout.
    """

    name: str
    open: Opener
    forks: bool = False
    sync_of: str | None = None


def measure_cases(
    cases: Sequence[Case], workload: Workload, timing: Timing, console: Console | None = None
) -> dict[str, RunResult | str]:
    """Open every case (forking ones first), then time their windows interleaved.

    Returns:
        For each case name, its :class:`RunResult` or, if it failed, ``"Type: message"``
        (printed, with its traceback, on ``console``).
    """

    def failed(name: str, exc: BaseException) -> None:
        if console is None:
            return
        console.print(f"[red]{name} failed[/red]: {type(exc).__name__}: {str(exc)[:300]}")
        if not isinstance(exc, ImportError):
            text = "".join(traceback.format_exception(exc))
            console.print(text[-2000:], markup=False, highlight=False)

    def timed(opener: Opener) -> Opener:
        def open_timed(workload: Workload, timing: Timing) -> Runner:
            start = time.perf_counter()
            runner = opener(workload, timing)
            if isinstance(runner, CallRunner) and not runner.setup_s:  # building and resetting
                runner.setup_s = time.perf_counter() - start - runner.warmup_s
            return runner

        return open_timed

    ordered = sorted(cases, key=lambda c: not c.forks)  # stable: forking ones first
    openers = {case.name: timed(case.open) for case in cases}
    results = measure([c.name for c in ordered], workload, timing, on_error=failed, openers=openers)
    # A case slower to start than the timing allows is reported like a failure: its reason.
    return {
        case.name: r if isinstance(r, RunResult | str) else str(r)
        for case in cases
        for r in [results[case.name]]
    }


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def median_of(results: dict[str, RunResult | str], name: str | None) -> float | None:
    result = results.get(name) if name is not None else None
    return result.median if isinstance(result, RunResult) else None


Column = tuple[str, Callable[[str, RunResult], str]]
"""A ratio column: header, and the cell for a row that did not fail."""


def results_table(
    console: Console,
    title: str,
    names: Sequence[str],
    results: dict[str, RunResult | str],
    columns: Sequence[Column] = (),
) -> dict[str, Any]:
    """Print one row per name (steps/s, ``columns``, setup, windows, other load); its JSON."""
    table = Table(title=title, title_justify="left")
    table.add_column("runner", no_wrap=True)
    table.add_column("steps/s", justify="right")
    for header, _ in columns:
        table.add_column(header, justify="right")
    for header in ("setup s", "windows", "other load"):
        table.add_column(header, justify="right")
    out: dict[str, Any] = {}
    for name in names:
        result = results[name]
        if isinstance(result, str):
            blanks = ["-"] * len(columns)
            table.add_row(name, "[red]failed[/red]", *blanks, "-", result[:70], "-")
            out[name] = {"error": result}
            continue
        table.add_row(
            name,
            f"{result.median:,.0f}",
            *(cell(name, result) for _, cell in columns),
            f"{result.setup_s:.1f}",
            " ".join(f"{w:,.0f}" for w in result.throughputs),
            " ".join(f"{c:.2f}" for c in result.other_load),
        )
        out[name] = {
            "steps_per_s": result.median,
            "windows": result.throughputs,
            "setup_s": result.setup_s,
            "other_load_cores": result.other_load,
            **result.info,
        }
    console.print(table)
    loads = [c for r in results.values() if isinstance(r, RunResult) for c in r.other_load]
    if loads and max(loads) > 0.2:
        console.print(
            f"[yellow]other processes kept up to {max(loads):.2f} cores busy during the windows "
            "('other load'): these numbers are skewed; compare ratios within a round[/yellow]"
        )
    return out


def script_parser(doc: str, default_json: Path) -> argparse.ArgumentParser:
    """The options every benchmark script takes: window, repeats, warm-up, seed, JSON, quick."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="windows per runner (default 3)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up s (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=default_json, help="where to write results")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 window of 0.5 s per runner"
    )
    return parser


def timing_from(args: argparse.Namespace) -> Timing:
    """The :class:`Timing` of :func:`script_parser`'s options (``--quick``: a smoke run)."""
    seconds, repeats, warmup, rewarm = (0.5, 1, 0.3, 0.1) if args.quick else (3.0, 3, 1.0, 0.2)
    return Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=args.warmup if args.warmup is not None else warmup,
        rewarm=rewarm,
        seed=args.seed,
    )


def save_json(path: Path, report: dict[str, Any], console: Console | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if console is not None:
        console.print(f"results written to {path}")


def discrete_actions(n: int, batch: int, seed: int, count: int = 64) -> list[np.ndarray]:
    """``count`` pre-sampled batches of ``batch`` actions of a ``Discrete(n)`` space."""
    rng = np.random.default_rng(seed)
    return list(rng.integers(0, n, size=(count, batch), dtype=np.int32))


def cycle(step: Callable[[Any], object], actions: Sequence[Any], envs_per_call: int) -> Any:
    """An ``advance`` for :class:`~envfleet.benchmark.CallRunner` that calls ``step`` with the
    actions in turn."""
    following = itertools.cycle(actions).__next__

    def advance() -> int:
        step(following())
        return envs_per_call

    return advance
