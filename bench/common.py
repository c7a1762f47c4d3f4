"""What the ``bench/`` scripts share: their own rows (:class:`Case`) measured side by side by
:func:`envfleet.benchmark.measure` and shown as one table, the options every script takes, its
console and log, and the ideal row.

A script lists its workloads and cases (a layout of workers, an async batch size, a peer
configured some way: a name and an opener with a registered runner's signature) and calls
:func:`measure_table`; :func:`session` gives it a console on the real stdout while what
libraries, envs and worker processes print goes to a log next to its JSON, as ``envfleet
bench`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from envfleet.benchmark import (
    CallRunner,
    Runner,
    RunResult,
    Timing,
    Workload,
    machine_info,
    time_calls,
)
from envfleet.benchmark import measure as measure_runners
from envfleet.cli.common import OutputCapture

Opener = Callable[[Workload, Timing], Runner]
RESULTS = Path(__file__).resolve().parent / "results"


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


# -- the console, the log, progress ------------------------------------------------------------


@contextlib.contextmanager
def session(json_path: Path, width: int = 120) -> Iterator[Console]:
    """A console on this process's stdout, while what is written to file descriptors 1 and 2
    (ale-py's banner, Ray's warnings, worker processes) goes to ``json_path`` with ``.log``."""
    stdout = os.fdopen(os.dup(1), "w", buffering=1)
    console = Console(file=stdout, width=max(Console().width, width))
    with OutputCapture() as captured:
        yield console
    if captured.text.strip():
        log = json_path.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(captured.text)
        lines = len(captured.text.splitlines())
        console.print(f"{lines} lines printed by libraries and envs: {log}", markup=False)


@contextlib.contextmanager
def progress(console: Console, title: str) -> Iterator[dict[str, Callable[[str], object]]]:
    """:func:`~envfleet.benchmark.measure`'s progress hooks: a live line on a terminal, else a
    line per runner as it starts."""
    if console.is_terminal:
        with console.status(title) as status:
            yield {"progress": lambda text: status.update(f"{title}: {text}")}
    else:
        yield {"on_stage": lambda text: console.print(text, markup=False, highlight=False)}


# -- measuring and tabulating ------------------------------------------------------------------


def measure_cases(
    cases: Sequence[Case],
    workload: Workload,
    timing: Timing,
    console: Console | None = None,
    **hooks: Callable[[str], object],
) -> dict[str, RunResult | str]:
    """Open every case (forking ones first), then time their windows interleaved.

    Returns:
        For each case name, its :class:`RunResult` or, if it failed (or was slower to start
        than the timing allows), ``"Type: message"`` (printed, with its traceback, on
        ``console``).
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

    ordered = [c.name for c in sorted(cases, key=lambda c: not c.forks)]  # forking ones first
    openers = {case.name: timed(case.open) for case in cases}
    results = measure_runners(ordered, workload, timing, on_error=failed, openers=openers, **hooks)
    return {c.name: r if isinstance(r, RunResult | str) else str(r) for c in cases
            for r in [results[c.name]]}  # fmt: skip


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def median_of(results: dict[str, RunResult | str], name: str | None) -> float | None:
    result = results.get(name) if name is not None else None
    return result.median if isinstance(result, RunResult) else None


Column = tuple[str, Callable[[str, RunResult], str]]
"""A ratio column: header, and the cell for a row that did not fail."""


def versus(header: str, base: float | None) -> Column:
    """A column of each row's median over ``base`` (``-`` when either is missing)."""
    return header, lambda _name, result: fmt(ratio(result.median, base))


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
    for header in ("steps/s", *(h for h, _ in columns), "setup s", "windows", "other load"):
        table.add_column(header, justify="right")
    out: dict[str, Any] = {}
    for name in names:
        result = results[name]
        if isinstance(result, str):
            table.add_row(name, "[red]failed[/red]", *["-"] * len(columns), "-", result[:70], "-")
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


@dataclass(frozen=True)
class Versus:
    """A ratio column: each row's median over row ``row``'s, headed ``header`` and, if ``key``
    is given, added to each row's JSON under ``key``."""

    header: str
    row: str
    key: str | None = None


def add_ratios(rows: dict[str, Any], key: str, base: float | None) -> None:
    """Add ``key``: steps/s over ``base`` to every measured row of a results table's JSON."""
    for row in rows.values():
        if "steps_per_s" in row:
            row[key] = ratio(row["steps_per_s"], base)


def measure_table(
    console: Console,
    title: str,
    cases: Sequence[Case],
    workload: Workload,
    timing: Timing,
    columns: Sequence[Versus | Column] = (),
) -> tuple[dict[str, RunResult | str], dict[str, Any]]:
    """Measure ``cases`` on ``workload`` (with progress) and print their table, titled
    ``title`` and the timing, with a ratio column per :class:`Versus` (or ready-made column);
    the results and the table's JSON."""
    with progress(console, f"{title}: {len(cases)} runners") as hooks:
        results = measure_cases(cases, workload, timing, console, **hooks)
    bases = [(c, median_of(results, c.row)) for c in columns if isinstance(c, Versus)]
    rows = results_table(
        console,
        f"{title} ({timing.repeats} x {timing.seconds:g} s, median)",
        [c.name for c in cases],
        results,
        [versus(c.header, median_of(results, c.row)) if isinstance(c, Versus) else c
         for c in columns],
    )  # fmt: skip
    for column, base in bases:
        if column.key is not None:
            add_ratios(rows, column.key, base)
    return results, rows


def target(
    console: Console, label: str, value: float | None, minimum: float, *, end: str = "\n"
) -> dict[str, Any]:
    """Print ``label = value (target >= minimum) met/missed``; its JSON (``met`` is ``None``
    when ``value`` was not measured)."""
    met = None if value is None else value >= minimum
    mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
    console.print(f"[bold]{label} = {fmt(value)}[/bold] (target >= {minimum:g}){mark}{end}")
    return {"ratio": label, "value": value, "minimum": minimum, "met": met}


# -- async layouts and the ideal row -----------------------------------------------------------


def layouts(
    prefix: str, batches: Sequence[int], opener: Callable[..., Runner], *, forks: bool, **kw: Any
) -> list[Case]:
    """A sync row (``prefix sync``) and one async row per batch size (``prefix B=8``, opened
    with ``batch_size=8``, its :attr:`~Case.sync_of` the sync row), for one runner layout."""
    sync = f"{prefix} sync"
    cases = [Case(sync, functools.partial(opener, **kw), forks=forks)]
    for b in batches:
        opens = functools.partial(opener, batch_size=b, **kw)
        cases.append(Case(f"{prefix} B={b}", opens, forks=forks, sync_of=sync))
    return cases


def own_sync_column(cases: Sequence[Case], results: dict[str, RunResult | str]) -> Column:
    """``vs own sync``: an async row over its :attr:`~Case.sync_of` row (a sync row: 1.00)."""
    sync_of = {c.name: c.sync_of or c.name for c in cases}

    def cell(name: str, result: RunResult) -> str:
        if sync_of[name] == name:
            return "1.00" if name.endswith(" sync") else "-"
        return fmt(ratio(result.median, median_of(results, sync_of[name])))

    return "vs own sync", cell


class IdealRunner(CallRunner):
    """One env stepped alone, counted ``num_envs`` times: ``num_envs / mean step time``.

    Its info also gets the sync ideal: ``num_envs / mean of the slowest of num_envs`` steps
    (bootstrapped from the step times of the last window), and the mean step in ms.
    """

    def __init__(self, workload: Workload, timing: Timing) -> None:
        env = workload.spec.build()
        env.reset(seed=timing.seed)
        n = workload.num_envs
        self.durations: list[float] = []

        def advance() -> int:
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(0)
            self.durations.append(time.perf_counter() - start)
            if terminated or truncated:
                env.reset()
            return n

        super().__init__("ideal", advance, env.close, timing, num_envs=n)

    def window(self, seconds: float) -> float:
        time_calls(self.advance, self._rewarm)
        self.durations.clear()  # the timed window's steps alone: rate <= num_envs / mean step
        rate = time_calls(self.advance, seconds)
        d = np.array(self.durations[-100_000:])
        if len(d) >= 10:
            n = self.info["num_envs"]
            slowest = d[np.random.default_rng(0).integers(0, len(d), size=(2000, n))].max(axis=1)
            self.info["mean_step_ms"] = float(d.mean() * 1e3)
            self.info["ideal_sync_steps_per_s"] = float(n / slowest.mean())
        return rate


# -- options, machine, JSON --------------------------------------------------------------------


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
    parser.add_argument("--quick", action="store_true", help="1 window of 0.5 s per runner")
    return parser


def timing_from(args: argparse.Namespace, full: tuple[float, int] = (3.0, 3)) -> Timing:
    """The :class:`Timing` of :func:`script_parser`'s options (``full``: the seconds and
    repeats without ``--quick``)."""
    seconds, repeats, warmup, rewarm = (0.5, 1, 0.3, 0.1) if args.quick else (*full, 1.0, 0.2)
    return Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=args.warmup if args.warmup is not None else warmup,
        rewarm=rewarm,
        seed=args.seed,
    )


def add_choice(parser: argparse.ArgumentParser, flag: str, choices: Sequence[str]) -> None:
    """A ``flag`` option taking a comma-separated subset of ``choices`` (default: all), as a
    list, checked."""

    def chosen(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or 'none'}: choose from {','.join(choices)}"
            )
        return names

    parser.add_argument(
        flag, type=chosen, default=list(choices), help=f"comma-separated, from {','.join(choices)}"
    )


def print_machine(console: Console, packages: Sequence[str] = ()) -> dict[str, Any]:
    """Print a one-line summary of :func:`~envfleet.benchmark.machine_info`; return it."""
    machine = machine_info(packages)
    load = machine["load_average_at_start"]
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, Python "
        f"{machine['python']}, load average {f'{load[0]:.2f}' if load else '-'}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    return machine


def save_json(path: Path, report: dict[str, Any], console: Console | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if console is not None:
        console.print(f"results written to {path}")
