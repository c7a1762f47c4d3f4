"""``envfleet run ENV``: step copies of an env with a policy, report throughput and returns.

It steps ``--num-envs`` copies of ``ENV`` with a policy (random by default) and prints a
summary: throughput and the returns of the episodes that finished (counted as
:mod:`envfleet.cli.runner` describes). ``--out FILE.npz`` saves the rollout (its columns:
:mod:`envfleet.cli.recorder`).

While it runs, stderr says what is happening from the first moment: a ``starting`` line (the
env, the workers, a Ray to start) before anything is built, a ``started`` line once the pool
is up, then a live progress bar with the steps/s and the time left when stderr is a terminal,
or, piped, a plain progress line every few seconds, and a ``done`` line
(:class:`~envfleet.cli.common.StageLog`). ``--quiet`` and ``--json`` leave stderr for errors.

``--stats`` adds the pool's per-worker statistics (:meth:`envfleet.Pool.stats`: step latency
p50/p99, idle fraction, steps, episodes, restarts) as a table, and under ``"stats"`` in
``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space
from rich.console import Console, JustifyMethod
from rich.table import Table

import envfleet
from envfleet._run_args import add_run_parser, check_run_args, out_path
from envfleet._starting import starting_line, workers
from envfleet.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    PROG,
    CliError,
    OutputCapture,
    StageLog,
    UsageError,
    clock,
    env_spec,
    print_whole,
    progress_console,
)
from envfleet.cli.recorder import Recorder
from envfleet.cli.runner import LiveDisplay, RandomPolicy, RunLoop, RunSummary, load_policy


def add_parser(commands: Any) -> None:
    """Add the ``run`` subcommand to ``commands`` (the top-level parser's subparsers)."""
    add_run_parser(commands).set_defaults(handler=_cmd_run)


_check_run_args = check_run_args
_out_path = out_path
_starting = starting_line


def _cmd_run(args: argparse.Namespace) -> int:
    # Bad input that is quick to tell is one error line, before anything starts ...
    _check_run_args(args)
    spec = env_spec(args.env)
    out = _out_path(args.out) if args.out is not None else None
    # ... then the first line, at once: a policy's imports (torch), building the env, starting
    # workers or a Ray may each take seconds.
    stderr, live = progress_console(args)
    stages = StageLog(stderr, enabled=not (args.json or args.quiet))
    if not getattr(args, "announced", False):  # else envfleet.__main__ printed it already
        stages.line(_starting(args))
    policy = load_policy(args.policy) if args.policy is not None else None
    # Libraries and envs print banners (ale-py's in every worker) and warnings: captured, and
    # what is not a known banner is shown after the run.
    with OutputCapture(replay=True, verbose=getattr(args, "verbose", False)) as captured:
        stderr, live = progress_console(args, captured.stderr)
        stages.console = stderr
        building = time.perf_counter()
        spinner: contextlib.AbstractContextManager[Any] = (
            stderr.status("building the pool") if live else contextlib.nullcontext()
        )
        with spinner:
            pool = _make_pool(args, spec)
        with pool:
            if args.address is not None:  # which cluster "auto" (or the address) was
                from envfleet.backends.ray.session import describe_cluster

                stages.line(f"joined {describe_cluster()}")
            stages.line(
                f"started {workers(args.backend, pool.num_workers)} in "
                f"{time.perf_counter() - building:.2f} s; running"
            )
            if policy is None:
                if pool.batch_size == pool.num_envs:
                    space: spaces.Space[Any] = pool.action_space
                else:
                    space = batch_space(pool.single_action_space, pool.batch_size)
                space.seed(args.seed)
                policy = RandomPolicy(space)
            recorder = (
                Recorder(
                    pool.num_envs,
                    pool.single_action_space,
                    pool.single_observation_space,
                    save_obs=args.save_obs,
                )
                if out is not None
                else None
            )
            display = LiveDisplay(stderr, args.env, args.steps, args.seconds) if live else None
            runner = RunLoop(
                pool,
                policy,
                args.policy or "random",
                steps=args.steps,
                seconds=args.seconds,
                recorder=recorder,
                display=display,
                stages=None if live else stages,
            )
            if display is not None:
                with display:
                    result = runner.run()
            else:
                result = runner.run()
            stats = pool.stats().as_dict() if args.stats else None
            restarts = int(pool.restarts.sum())
    stderr, _ = progress_console(args)
    stages.console = stderr
    rate = result.steps / result.seconds if result.seconds > 0 else 0.0
    stages.line(
        f"{'interrupted' if result.interrupted else 'done'}: {result.steps:,} steps in "
        f"{clock(result.seconds)} ({rate:,.0f} steps/s)"
    )

    if recorder is not None and out is not None:
        try:
            recorder.save(out)
        except OSError as exc:
            raise CliError(f"writing {out} failed: {exc.strerror or exc}") from exc
    summary = _summary(args, result, out)
    summary["restarts"] = restarts
    if stats is not None:
        summary["stats"] = stats
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        console = Console(highlight=False)
        tables: list[Any] = [_summary_table(summary)]
        if stats is not None:
            tables.append(_stats_table(stats, synchronous=summary["batch_size"] == args.num_envs))
        print_whole(console, *tables)
    if result.interrupted:
        if not stages.enabled:  # else the "interrupted" stage line said it
            stderr.print(f"{PROG}: interrupted after {result.steps:,} steps")
        return EXIT_INTERRUPTED
    return EXIT_OK


def _make_pool(args: argparse.Namespace, spec: Any) -> envfleet.Pool:
    try:
        return envfleet.make(
            spec,
            args.num_envs,
            backend=args.backend,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
            seed=args.seed,
            autoreset_mode=AutoresetMode.NEXT_STEP,
            threads_per_worker=args.threads_per_worker,
            cpu_affinity=args.cpu_affinity,
            vectorization_mode=None
            if args.vectorization_mode == "none"
            else args.vectorization_mode,
            on_error=args.on_error,
            step_timeout=args.step_timeout,
            max_restarts=args.max_restarts,
            address=args.address,
        )
    except envfleet.EnvError:  # the env failed (of its own exception type too): not usage
        raise
    except (ValueError, TypeError) as exc:  # envfleet.make's checks on its arguments
        raise UsageError(str(exc)) from exc


def _summary(args: argparse.Namespace, result: RunSummary, out: Path | None) -> dict[str, Any]:
    returns = np.asarray(result.tracker.returns, dtype=np.float64)
    lengths = np.asarray(result.tracker.lengths, dtype=np.float64)
    some = returns.size > 0
    return {
        "env": args.env,
        "backend": args.backend,
        "num_envs": args.num_envs,
        "num_workers": result.num_workers,
        "batch_size": args.batch_size or args.num_envs,
        "seed": args.seed,
        "threads_per_worker": args.threads_per_worker,
        "vectorization_mode": args.vectorization_mode,
        "cpu_affinity": args.cpu_affinity,
        "on_error": args.on_error,
        "policy": args.policy or "random",
        "steps": result.steps,
        "seconds": result.seconds,
        "steps_per_second": result.steps / result.seconds if result.seconds > 0 else None,
        "episodes": int(returns.size),
        "return_mean": float(returns.mean()) if some else None,
        "return_min": float(returns.min()) if some else None,
        "return_max": float(returns.max()) if some else None,
        "length_mean": float(lengths.mean()) if some else None,
        "interrupted": result.interrupted,
        "out": str(out) if out is not None else None,
    }


def _summary_table(summary: dict[str, Any]) -> Table:
    def number(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    table = Table(title=f"{PROG} run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("env", summary["env"]),
        ("backend", summary["backend"]),
        ("num_envs", str(summary["num_envs"])),
        ("workers", str(summary["num_workers"] or "-")),
        ("batch_size", str(summary["batch_size"])),
        ("policy", summary["policy"]),
        ("steps", f"{summary['steps']:,}"),
        ("seconds", number(summary["seconds"])),
        ("steps/s", number(summary["steps_per_second"], 0)),
        ("episodes", f"{summary['episodes']:,}"),
        ("mean return", number(summary["return_mean"])),
        ("min return", number(summary["return_min"])),
        ("max return", number(summary["return_max"])),
        ("mean length", number(summary["length_mean"], 1)),
    ]
    if summary.get("restarts"):
        rows.append(("env restarts", f"{summary['restarts']:,}"))
    if summary["interrupted"]:
        rows.append(("interrupted", "yes"))
    if summary["out"] is not None:
        rows.append(("saved", summary["out"]))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _env_range(env_ids: Sequence[int]) -> str:
    """``0-3`` for a contiguous block of env ids, else the ids."""
    ids = list(env_ids)
    if not ids:
        return "-"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _stats_table(stats: dict[str, Any], synchronous: bool) -> Table:
    """:meth:`envfleet.Pool.stats` (as a dict), one row per worker and a total.

    On a synchronous run the pool sends every worker its command at once and takes their replies
    in one wait: a step's latency and busy time are the whole step's, recorded alike for every
    worker (the slowest one sets them; only the steps whose replies were taken one by one, as
    the first, differ). Identical rows are then what was measured, and a caption says so rather
    than let them pass for a coincidence or a bug.
    """

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    workers = stats["workers"]
    caption = None
    if synchronous and len(workers) > 1:
        caption = (
            "synchronous steps: every worker gets each step at once and the pool takes all the "
            "replies in one wait, so p50/p99 and idle are mostly the whole step's, the same for "
            "every worker (the slowest sets them); per-worker figures show with --batch-size "
            "below --num-envs"
        )
    table = Table(
        title=f"pool stats over {stats['seconds']:.2f} s",
        title_justify="left",
        show_footer=True,
        caption=caption,
        caption_justify="left",
    )
    idle = [w["idle_fraction"] for w in workers]
    columns: list[tuple[str, str, JustifyMethod]] = [
        ("worker", "total", "left"),
        ("envs", str(sum(len(w["env_ids"]) for w in workers)), "left"),
        ("steps", f"{stats['steps']:,}", "right"),
        ("episodes", f"{stats['episodes']:,}", "right"),
        ("restarts", f"{stats['restarts']:,}", "right"),
        ("p50 ms", "", "right"),
        ("p99 ms", "", "right"),
        ("idle", f"{sum(idle) / len(idle):.0%}" if idle else "-", "right"),
    ]
    for header, footer, justify in columns:
        table.add_column(header, footer=footer, justify=justify)
    for w in workers:
        table.add_row(
            str(w["worker"]),
            _env_range(w["env_ids"]),
            f"{w['steps']:,}",
            f"{w['episodes']:,}",
            f"{w['restarts']:,}",
            ms(w["latency_p50_ms"]),
            ms(w["latency_p99_ms"]),
            f"{w['idle_fraction']:.0%}",
        )
    return table


__all__ = ["add_parser"]
