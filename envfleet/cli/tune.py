"""``envfleet tune ENV``: measure an env and find the fastest pool layout for it.

It probes the env (step time and its variation, reset cost, CPU share, observation bytes),
times a few layouts (backend, workers, threads per worker, batch size) within ``--budget``
seconds and prints the fastest with the ``envfleet.make(...)`` line to use. The probe and the
candidate layouts come from :mod:`envfleet.tune`; this module shares the budget among them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from envfleet.affinity import usable_cpus
from envfleet.cli.common import (
    EXIT_OK,
    CliError,
    env_spec,
    positive_float,
    positive_int,
    progress_console,
)
from envfleet.spec import EnvSpec
from envfleet.tune import EnvProfile, Layout, candidate_layouts, profile_env, time_layout

DEFAULT_TUNE_BUDGET = 20.0
TUNE_MIN_WINDOW = 0.1
"""Seconds each layout is timed for at the least, whatever the budget."""
TUNE_SETUP_GUESS = 0.3
"""Seconds to start and close a pool, before one has been measured."""


def add_parser(commands: Any) -> None:
    """Add the ``tune`` subcommand to ``commands`` (the top-level parser's subparsers)."""
    tune = commands.add_parser(
        "tune",
        help="measure an environment and find the fastest pool layout for it",
        description=(
            "Probe ENV (step time and its variation, reset cost, CPU share, observation size), "
            "time a few layouts (backend, workers, threads per worker, batch size) of NUM_ENVS "
            "envs within the budget, and print the fastest with the envfleet.make(...) line "
            "that uses it. envfleet.make(..., num_workers='auto') applies the same kind of "
            "choice from a shorter probe."
        ),
        allow_abbrev=False,
    )
    tune.add_argument("env", metavar="ENV", help="a registered env id, e.g. CartPole-v1")
    tune.add_argument(
        "--num-envs", type=positive_int, default=8, help="number of envs (default: 8)"
    )
    tune.add_argument(
        "--budget",
        type=positive_float,
        default=DEFAULT_TUNE_BUDGET,
        metavar="SECONDS",
        help=(
            "about how long the whole tuning takes, shared among the layouts "
            f"(default: {DEFAULT_TUNE_BUDGET:g})"
        ),
    )
    tune.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout, nothing else"
    )
    tune.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    tune.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    tune.set_defaults(handler=_cmd_tune)


@dataclass
class LayoutTiming:
    """One layout timed by ``envfleet tune``."""

    layout: Layout
    window_s: float
    steps_per_second: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.layout.backend,
            "num_workers": self.layout.num_workers,
            "threads_per_worker": self.layout.threads_per_worker,
            "batch_size": self.layout.batch_size,
            "cpu_affinity": self.layout.make_kwargs().get("cpu_affinity"),
            "make_kwargs": self.layout.make_kwargs(),
            "window_s": self.window_s,
            "steps_per_second": self.steps_per_second,
            "error": self.error,
        }


def tune_layouts(
    spec: EnvSpec,
    num_envs: int,
    budget: float,
    *,
    cores: int | None = None,
    progress: Callable[[str], object] | None = None,
) -> tuple[EnvProfile, list[LayoutTiming]]:
    """Probe the env, then time each candidate layout with what is left of ``budget`` seconds.

    Each layout gets an equal share of the time left when its turn comes, less what starting
    and closing a pool has cost so far (at least :data:`TUNE_MIN_WINDOW` seconds of stepping).
    """
    cores = cores or len(usable_cpus())
    start = time.perf_counter()
    deadline = start + budget
    try:
        profile = profile_env(spec, seconds=min(0.3, budget / 20))
    except Exception as exc:
        raise CliError(f"probing {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    layouts = candidate_layouts(profile, num_envs, cores)
    overheads: list[float] = []
    timings: list[LayoutTiming] = []
    for index, layout in enumerate(layouts):
        setup = sum(overheads) / len(overheads) if overheads else TUNE_SETUP_GUESS
        share = (deadline - time.perf_counter()) / (len(layouts) - index)
        window = max(TUNE_MIN_WINDOW, share - setup)
        if progress is not None:
            progress(f"{spec.name}: layout {index + 1}/{len(layouts)}: {_layout_text(layout)}")
        timing = LayoutTiming(layout, window)
        began = time.perf_counter()
        try:
            timing.steps_per_second = time_layout(spec, num_envs, layout, window)
        except Exception as exc:
            timing.error = f"{type(exc).__name__}: {exc}"
        overheads.append(max(0.0, time.perf_counter() - began - window))
        timings.append(timing)
    return profile, timings


def _layout_text(layout: Layout) -> str:
    parts = [layout.backend, f"{layout.num_workers} worker{'s' * (layout.num_workers != 1)}"]
    if layout.threads_per_worker > 1:
        parts.append(f"{layout.threads_per_worker} threads each")
    if layout.batch_size is not None:
        parts.append(f"batch {layout.batch_size}")
    if layout.cpu_affinity is not None:
        parts.append(f"cpus {_cpus_text(layout)}")
    return ", ".join(parts)


def _cpus_text(layout: Layout) -> str:
    affinity = layout.cpu_affinity
    if affinity is None:
        return "any"
    return affinity if isinstance(affinity, str) else ",".join(map(str, affinity))


def _profile_table(env: str, num_envs: int, cores: int, profile: EnvProfile) -> Table:
    table = Table(title=f"{env}: one env, probed", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    kind = "waits (sleeps, I/O)" if profile.waits else "computes"
    for name, value in (
        ("step time", f"{profile.step_seconds * 1e6:,.1f} µs"),
        ("step time variation (cv)", f"{profile.step_cv:.2f}"),
        ("reset time", f"{profile.reset_seconds * 1e6:,.1f} µs"),
        ("CPU share of a step", f"{profile.cpu_share:.2f} ({kind})"),
        ("observation", f"{profile.observation_bytes:,} bytes"),
        ("envs / usable cores", f"{num_envs} / {cores}"),
    ):
        table.add_row(name, value)
    return table


def _layouts_table(timings: list[LayoutTiming], best: LayoutTiming) -> Table:
    table = Table(title="layouts, random actions", title_justify="left")
    for header, justify in (
        ("backend", "left"),
        ("workers", "right"),
        ("threads/worker", "right"),
        ("batch", "right"),
        ("cpus", "right"),
        ("window s", "right"),
        ("steps/s", "right"),
        ("/ best", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    top = best.steps_per_second or 0.0
    for timing in timings:
        layout, rate = timing.layout, timing.steps_per_second
        table.add_row(
            layout.backend,
            str(layout.num_workers),
            str(layout.threads_per_worker),
            "all" if layout.batch_size is None else str(layout.batch_size),
            _cpus_text(layout),
            f"{timing.window_s:.2f}",
            "[red]failed[/red]" if rate is None else f"{rate:,.0f}",
            "-" if rate is None or not top else f"{rate / top:.2f}",
            style="bold" if timing is best else None,
        )
    return table


def _cmd_tune(args: argparse.Namespace) -> int:
    spec = env_spec(args.env)
    cores = len(usable_cpus())
    stderr, live = progress_console(args)
    start = time.perf_counter()
    if live:
        with stderr.status(f"{spec.name}: probing") as status:
            profile, timings = tune_layouts(
                spec,
                args.num_envs,
                args.budget,
                cores=cores,
                progress=lambda text: status.update(Text(text)),
            )
    else:
        profile, timings = tune_layouts(spec, args.num_envs, args.budget, cores=cores)
    elapsed = time.perf_counter() - start
    measured = [t for t in timings if t.steps_per_second is not None]
    if not measured:
        raise CliError(
            f"every layout failed; the first: {_layout_text(timings[0].layout)}: {timings[0].error}"
        )
    best = max(measured, key=lambda t: t.steps_per_second or 0.0)
    line = best.layout.describe(args.env, args.num_envs)
    if args.json:
        document = {
            "env": args.env,
            "num_envs": args.num_envs,
            "budget_s": args.budget,
            "seconds": elapsed,
            "usable_cores": cores,
            "profile": profile.as_dict(),
            "layouts": [t.as_dict() for t in timings],
            "best": best.as_dict(),
            "make": line,
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return EXIT_OK
    console = Console(highlight=False)
    console.print(_profile_table(spec.name, args.num_envs, cores, profile))
    console.print(_layouts_table(timings, best))
    console.print(
        f"best: {_layout_text(best.layout)}: {best.steps_per_second:,.0f} steps/s "
        f"(tuned in {elapsed:.1f} s)",
        markup=False,
        soft_wrap=True,
    )
    console.print(line, markup=False, soft_wrap=True)
    return EXIT_OK
