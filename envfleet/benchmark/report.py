"""What a sweep measured (:class:`Report`) and its renderings: a table with notes, a plot and
JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from envfleet.benchmark import base
from envfleet.benchmark.registry import RUNNERS, Availability


@dataclass
class Report:
    """What :func:`sweep` measured.

    Attributes:
        env: the env's name.
        num_envs: the env counts swept, in order.
        runners: every runner asked for, in order (measured or not).
        timing: how it was measured.
        availability: per runner asked for, whether it could run.
        results: per measured runner, per env count, its result, the error message, or
            :class:`Skipped` (start-up over the limit).
        machine: :func:`machine_info`.
        seconds: wall-clock time of the sweep.
        interrupted: the sweep was stopped (Ctrl-C) before it finished.
    """

    env: str
    num_envs: list[int]
    runners: list[str]
    timing: base.Timing
    availability: dict[str, Availability]
    results: dict[str, dict[int, base.RunResult | str | base.Skipped]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def measured(self) -> list[str]:
        """The runners that were run (available ones), in order."""
        return [name for name in self.runners if self.availability[name].ok]

    def rate(self, name: str, num_envs: int) -> float | None:
        """Median env-steps/s of ``name`` at ``num_envs``, if it was measured."""
        result = self.results.get(name, {}).get(num_envs)
        return result.median if isinstance(result, base.RunResult) else None

    def ratio(self, name: str, num_envs: int, reference: str = base.CEILING) -> float | None:
        """``name``'s throughput over ``reference``'s at ``num_envs`` (:meth:`RunResult.over`:
        paired by round), if both were measured."""
        value = self.results.get(name, {}).get(num_envs)
        against = self.results.get(reference, {}).get(num_envs)
        if not isinstance(value, base.RunResult) or not isinstance(against, base.RunResult):
            return None
        return value.over(against) if against.median else None

    def errors(self) -> dict[str, dict[int, str]]:
        """Per runner that failed somewhere, its error message per env count."""
        failed = {
            name: {n: r for n, r in points.items() if isinstance(r, str)}
            for name, points in self.results.items()
        }
        return {name: errors for name, errors in failed.items() if errors}

    def status(self, name: str) -> str:
        if not self.availability[name].ok:
            return self.availability[name].status
        points = list(self.results.get(name, {}).values())
        failed = [isinstance(r, str) for r in points]
        if failed and all(failed):
            return base.FAILED
        skipped = [isinstance(r, base.Skipped) for r in points]
        if skipped and all(skipped):
            return base.SKIPPED
        return base.PARTIAL if any(failed) or any(skipped) else base.OK

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for JSON."""
        runners: dict[str, Any] = {}
        for name in self.runners:
            entry: dict[str, Any] = {"status": self.status(name)}
            if name in RUNNERS:
                entry["description"] = RUNNERS[name].description
            if not self.availability[name].ok:
                entry["reason"] = self.availability[name].reason
                runners[name] = entry
                continue
            points = []
            for n, result in self.results.get(name, {}).items():
                if isinstance(result, str):
                    points.append({"num_envs": n, "error": result})
                    continue
                if isinstance(result, base.Skipped):
                    points.append({"num_envs": n, "skipped": result.reason})
                    continue
                points.append(
                    {
                        "num_envs": n,
                        "steps_per_s": result.median,
                        "ratio_to_ceiling": self.ratio(name, n, base.CEILING),
                        "ratio_to_loop": self.ratio(name, n, base.LOOP),
                        "windows": result.throughputs,
                        "setup_s": result.setup_s,
                        "other_load_cores": result.other_load,
                        **({"info": result.info} if result.info else {}),
                    }
                )
            entry["results"] = points
            runners[name] = entry
        return {
            "env": self.env,
            "num_envs": self.num_envs,
            "runners": runners,
            "not_installed": [
                n for n in self.runners if self.availability[n].status == base.NOT_INSTALLED
            ],
            "timing": self.timing.as_dict(),
            "machine": self.machine,
            "seconds": self.seconds,
            "interrupted": self.interrupted,
        }


# -- output ----------------------------------------------------------------------------------


Column = tuple[str, Callable[["Report", str, int], str]]
"""A column of a script's own: its header, and its cell for a runner's result at an env count
(``cell(report, name, num_envs)``, called where that result was measured)."""


def _table(
    report: Report, title: str, headers: Sequence[str], cells: Callable[[str, int, Any], list[str]]
) -> Table:
    """One row per measured runner; per env count, ``n envs`` and ``headers`` columns, whose
    cells are ``cells(name, n, result)``."""
    table = Table(title=title, title_justify="left", min_width=len(title) + 2)
    table.add_column("runner", no_wrap=True)
    for n in report.num_envs:
        for header in (f"{n} envs", *headers):
            table.add_column(header, justify="right")
    for name in report.measured:
        row = [name]
        for n in report.num_envs:
            row += cells(name, n, report.results.get(name, {}).get(n))
        table.add_row(*row)
    return table


def report_table(
    report: Report, reference: str = base.CEILING, columns: Sequence[Column] = ()
) -> Table:
    """One row per measured runner; per env count, steps/s, the ratio to ``reference`` (when
    it was measured) and ``columns``."""
    timing = report.timing
    shown = reference in report.measured  # a ratio column
    title = f"{report.env}: env-steps/s, median of {timing.repeats} x {timing.seconds:g} s"
    title += "; ratios paired by round" if shown else ""
    title += " (interrupted)" if report.interrupted else ""
    ratio = [f"/{reference}"] if shown else []

    def cells(name: str, n: int, result: Any) -> list[str]:
        if isinstance(result, str | base.Skipped):
            row = ["[red]failed[/red]" if isinstance(result, str) else "skipped"]
        else:
            row = ["-" if result is None else f"{result.median:,.0f}"]
        value = report.ratio(name, n, reference)
        row += ["-" if value is None else f"{value:.2f}"] if ratio else []
        measured = isinstance(result, base.RunResult)
        return row + [cell(report, name, n) if measured else "-" for _, cell in columns]

    return _table(report, title, ratio + [header for header, _ in columns], cells)


def startup_table(report: Report) -> Table:
    """One row per measured runner; per env count, the seconds it took to start (build and
    reset its envs), ``>N`` where it was stopped at the limit of ``N`` seconds."""
    limit = report.timing.startup_limit
    title = "start-up, seconds to build and reset the envs"
    title += f" (limit {limit:g} s)" if limit is not None else ""

    def cells(name: str, n: int, result: Any) -> list[str]:
        if isinstance(result, base.RunResult):
            return [f"{result.setup_s:.2f}"]
        return [f">{limit:g}" if isinstance(result, base.Skipped) and limit is not None else "-"]

    return _table(report, title, [], cells)


def report_notes(report: Report) -> list[str]:
    """What to keep in mind reading the table: load from elsewhere, peers' own env ids."""
    notes = []
    loads = [
        c
        for points in report.results.values()
        for r in points.values()
        if isinstance(r, base.RunResult)
        for c in r.other_load
    ]
    if loads and max(loads) > 0.1:
        notes.append(
            f"other processes kept up to {max(loads):.2f} cores busy during the windows: "
            "these numbers are skewed"
        )
    if "envpool" in report.measured:
        notes.append("envpool steps its own implementation of the env, not Gymnasium's")
    for name, points in report.results.items():
        skipped = [(n, r) for n, r in points.items() if isinstance(r, base.Skipped)]
        if skipped:
            first_n, first = skipped[0]
            counts = ", ".join(str(n) for n, _ in skipped)
            notes.append(
                f"{name}: {first.reason.split(',')[0]} at {first_n} envs; skipped at {counts} envs"
            )
    return notes


def plot_label(report: Report, name: str) -> str:
    """Runner ``name``'s label in the plot: its name, and the env counts where it was skipped
    (start-up over the limit) or failed."""
    results = report.results.get(name, {})
    gaps = [
        f"{how} at {', '.join(at)}"
        for how, kind in (("skipped", base.Skipped), ("failed", str))
        if (at := [str(n) for n, r in results.items() if isinstance(r, kind)])
    ]
    return f"{name} ({'; '.join(gaps)})" if gaps else name


def write_plot(report: Report, path: Path) -> None:
    """Throughput against ``num_envs``, one line per runner, as a PNG; a runner skipped or
    failed at some env counts says so in the legend, and the notes (load from elsewhere that
    skewed the windows, skips) are printed under the plot."""
    from matplotlib.figure import Figure

    notes = report_notes(report)
    fig = Figure(figsize=(8, 5 + 0.2 * len(notes)), layout="constrained")
    ax = fig.subplots()
    for name in report.measured:
        points = [(n, rate) for n in report.num_envs if (rate := report.rate(name, n)) is not None]
        label = plot_label(report, name)
        style: dict[str, Any] = (
            {"linestyle": "--", "color": "black"} if name == base.CEILING else {}
        )
        ax.plot([n for n, _ in points], [r for _, r in points], marker="o", label=label, **style)
    if min(report.num_envs) > 0 and max(report.num_envs) / min(report.num_envs) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(report.num_envs, [str(n) for n in report.num_envs])
    ax.set_xlabel("num_envs")
    ax.set_ylabel("env-steps per second")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")
    cores = report.machine.get("usable_cores")
    ax.set_title(
        f"{report.env}: throughput vs num_envs"
        + (f" ({cores} cores, median of {report.timing.repeats})" if cores else "")
        + (" (interrupted)" if report.interrupted else "")
    )
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside right upper", fontsize="small")
    if notes:
        fig.supxlabel("\n".join(notes), fontsize="small", color="firebrick", ha="left", x=0.01)
    fig.savefig(path, dpi=100)


def write_json(report: Report, path: Path, **extra: Any) -> dict[str, Any]:
    """Write :meth:`Report.as_dict` (plus ``extra``) to ``path``; return what was written."""
    document = {**report.as_dict(), **extra}
    path.write_text(json.dumps(document, indent=2, default=_jsonable) + "\n")
    return document


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


__all__ = [
    "Column",
    "Report",
    "plot_label",
    "report_notes",
    "report_table",
    "startup_table",
    "write_json",
    "write_plot",
]
