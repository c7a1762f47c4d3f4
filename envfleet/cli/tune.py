"""``envfleet tune ENV``: measure an env and find the fastest pool layout for it.

It probes the env (step time and its variation, reset cost, CPU share, observation bytes),
times a few layouts (backend, workers, threads per worker, batch size) within ``--budget``
seconds and prints the fastest with the ``envfleet.make(...)`` line to use. The probe and the
candidate layouts come from :mod:`envfleet.tune`; timing them within the budget is
:mod:`envfleet.cli.layout_timing`'s; this module is the command and its tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from envfleet.affinity import usable_cpus
from envfleet.cli.common import (
    EXIT_OK,
    CliError,
    OutputCapture,
    add_import_argument,
    env_spec,
    positive_float,
    positive_int,
    print_whole,
    progress_console,
)
from envfleet.cli.layout_timing import LayoutTiming, cpus_text, layout_text, tune_layouts
from envfleet.cli.runner import load_policy
from envfleet.tune import EnvProfile

DEFAULT_TUNE_BUDGET = 20.0


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
    tune.add_argument(
        "env",
        metavar="ENV",
        help="a registered env id, e.g. CartPole-v1, or module:Env-v0 to import module first",
    )
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
        "--policy",
        metavar="MODULE:FUNCTION",
        help=(
            "time every layout with this policy in the loop (called with each batch of "
            "observations, returning its actions, as `envfleet run --policy` does): its cost "
            "decides between sync and double-buffered async layouts; default: random actions, "
            "no policy cost"
        ),
    )
    tune.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout, nothing else"
    )
    tune.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    add_import_argument(tune)
    tune.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    tune.set_defaults(handler=_cmd_tune)


def human_seconds(seconds: float) -> str:
    """A duration in the unit that reads best: ``850 ns``, ``42.5 µs``, ``602 ms``, ``1.25 s``."""
    for name, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            value, unit = seconds / scale, name
            break
    else:
        return f"{seconds * 1e9:.0f} ns"
    return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"


def suggested_budget(budget: float, elapsed: float, timed: int, total: int) -> float:
    """A ``--budget`` that leaves time for all ``total`` layouts, where only ``timed`` were
    timed in ``elapsed`` seconds of a ``budget``: the time per layout so far times the layouts,
    rounded up to 5 s."""
    per_layout = max(elapsed, budget) / max(1, timed)
    return float(5 * math.ceil(per_layout * total / 5))


def _profile_table(env: str, num_envs: int, cores: int, profile: EnvProfile) -> Table:
    table = Table(title=f"{env}: one env, probed", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    kind = "waits (sleeps, I/O)" if profile.waits else "computes"
    for name, value in (
        ("step time", human_seconds(profile.step_seconds)),
        ("step time variation (cv)", f"{profile.step_cv:.2f}"),
        ("reset time", human_seconds(profile.reset_seconds)),
        ("CPU share of a step", f"{profile.cpu_share:.2f} ({kind})"),
        ("observation", f"{profile.observation_bytes:,} bytes"),
        ("envs / usable cores", f"{num_envs} / {cores}"),
    ):
        table.add_row(name, value)
    return table


def _layouts_table(
    timings: list[LayoutTiming], best: LayoutTiming, policy: str | None = None
) -> Table:
    """One row per layout; the title names what chose the actions (``--policy``, or random)."""
    actions = "random actions" if policy is None else f"actions by {policy}"
    table = Table(title=f"layouts, {actions}", title_justify="left")
    table.add_column("backend", justify="left")
    for header in ("workers", "threads/worker", "batch", "cpus", "window s", "steps/s", "/ best"):
        table.add_column(header, justify="right")
    table.add_column("note")
    if any(timing.layout.vectorization_mode for timing in timings):
        table.caption = "(hosted): each worker hosts the env's own VectorEnv for its block"
    top = best.steps_per_second or 0.0
    for timing in timings:
        layout, rate = timing.layout, timing.steps_per_second
        if timing.skipped is not None:
            shown, ratio, note = "-", "-", f"not timed: {timing.skipped}"
        elif rate is None:
            shown, ratio, note = "[red]failed[/red]", "-", ""
        elif timing.untrusted is not None:
            shown, ratio, note = f"~{rate:,.0f}", "?", f"untrusted: {timing.untrusted}"
        else:
            shown, ratio, note = f"{rate:,.0f}", f"{rate / top:.2f}" if top else "-", ""
        table.add_row(
            layout.backend.value + (" (hosted)" if layout.vectorization_mode else ""),
            str(layout.num_workers),
            str(layout.threads_per_worker),
            "all" if layout.batch_size is None else str(layout.batch_size),
            cpus_text(layout),
            f"{timing.window_s:.2f}",
            shown,
            ratio,
            Text(note),
            style="bold" if timing is best else None,
        )
    return table


def _cmd_tune(args: argparse.Namespace) -> int:
    spec = env_spec(args.env)
    policy = load_policy(args.policy) if args.policy else None
    cores = len(usable_cpus())
    start = time.perf_counter()
    # Libraries and envs print banners (ale-py's in every worker): shown after, known ones left
    # out.
    with OutputCapture(replay=True) as captured:
        stderr, live = progress_console(args, captured.stderr)
        if live:
            with stderr.status(f"{spec.name}: probing") as status:
                profile, timings = tune_layouts(
                    spec,
                    args.num_envs,
                    args.budget,
                    cores=cores,
                    progress=lambda text: status.update(Text(text)),
                    policy=policy,
                )
        else:
            profile, timings = tune_layouts(
                spec, args.num_envs, args.budget, cores=cores, policy=policy
            )
    elapsed = time.perf_counter() - start
    ranked = [t for t in timings if t.ranked]
    if not ranked:
        first = timings[0]
        if first.untrusted is not None:
            raise CliError(
                f"no layout could be timed well enough to rank: {layout_text(first.layout)}: "
                f"{first.untrusted}; give a larger --budget"
            )
        raise CliError(
            f"every layout failed; the first: {layout_text(first.layout)}: {first.error}"
        )
    best = max(ranked, key=lambda t: t.steps_per_second or 0.0)
    line = best.layout.describe(args.env, args.num_envs)
    timed = sum(1 for t in timings if t.skipped is None)
    suggestion = (
        suggested_budget(args.budget, elapsed, timed, len(timings))
        if timed < len(timings)
        else None
    )
    if args.json:
        document = {
            "env": args.env,
            "num_envs": args.num_envs,
            "budget_s": args.budget,
            "seconds": elapsed,
            "usable_cores": cores,
            "policy": args.policy,
            "profile": profile.as_dict(),
            "layouts": [t.as_dict() for t in timings],
            "best": best.as_dict(),
            "make": line,
            "timed_layouts": timed,
            "candidate_layouts": len(timings),
            "suggested_budget_s": suggestion,
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return EXIT_OK
    console = Console(highlight=False)
    print_whole(
        console,
        _profile_table(spec.name, args.num_envs, cores, profile),
        _layouts_table(timings, best, args.policy),
    )
    if suggestion is not None:
        console.print(
            f"timed {timed} of {len(timings)} layouts before the {args.budget:g} s budget was "
            f"spent; the others may be faster: time them all with --budget {suggestion:g}",
            markup=False,
            soft_wrap=True,
        )
    scope = (
        f"all {len(timings)} layouts timed"
        if suggestion is None
        else (f"{timed} of {len(timings)} layouts timed")
    )
    console.print(
        f"best: {layout_text(best.layout)}: {best.steps_per_second:,.0f} steps/s "
        f"({scope}, in {elapsed:.1f} s)",
        markup=False,
        soft_wrap=True,
    )
    console.print(line, markup=False, soft_wrap=True)
    return EXIT_OK


__all__ = [
    "DEFAULT_TUNE_BUDGET",
    "add_parser",
    "human_seconds",
    "suggested_budget",
]
