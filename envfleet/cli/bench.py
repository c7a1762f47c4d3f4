"""``envfleet bench ENV``: measure envfleet against a for-loop, the ceiling and peer libraries.

It measures, side by side in one run, a for-loop, the independent-processes ceiling,
envfleet's backends and the peer libraries that are installed, for each ``--num-envs`` of a
list (see :mod:`envfleet.benchmark`); it prints a table (steps/s, ratio to the ceiling) and
writes ``bench.json`` and ``bench.png`` (throughput against ``num_envs``) to ``--out DIR``.
A runner that fails is reported on stderr, and the command exits with status 1 once the
results are written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from envfleet import benchmark
from envfleet.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    PROG,
    CliError,
    OutputCapture,
    UsageError,
    add_import_argument,
    env_spec,
    non_negative_int,
    one_line,
    positive_float,
    positive_int,
    print_whole,
    progress_console,
)
from envfleet.spec import EnvSpec
from envfleet.tune import has_vector_entry_point

DEFAULT_BENCH_NUM_ENVS = (8, 32, 64)
DEFAULT_BENCH_OUT = Path("envfleet-bench")
DEFAULT_BENCH_SECONDS = 0.3
DEFAULT_STARTUP_LIMIT = 10.0
"""Seconds a runner may take to start (SB3's SubprocVecEnv starts one process per env, each
importing its libraries: minutes for 64 envs on 2 cores); one slower is skipped, and not
tried at larger env counts (nor is one expected to be far slower: see
:func:`envfleet.benchmark.sweep`)."""
DEFAULT_BENCH_REPEATS = 3
QUICK_NUM_ENVS = (8,)
QUICK_RUNNERS = ("loop", "ceiling", "process", "gym-async")
HOSTED_RUNNERS = ("vector", "vector-ceiling", "hosted", "process")
"""``--vectorization-mode vector_entry_point``: the id's own VectorEnv alone and one per core
(its ceiling), envfleet hosting it, and envfleet's single-env path."""
QUICK_SECONDS = 0.2
QUICK_REPEATS = 1
"""``--quick``: one env count, the for-loop, the ceiling, envfleet's process backend and
Gymnasium's AsyncVectorEnv, one short window each (no peer library imported): a first look in
seconds. Options given beside it win."""


def _num_envs_list(text: str) -> list[int]:
    """``"8,32,64"``: positive env counts, duplicates dropped, in the order given."""
    values: list[int] = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers such as 8,32,64, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"env counts must be at least 1, got {value}")
        if value not in values:
            values.append(value)
    return values


def _runner_list(text: str) -> list[str]:
    try:
        return benchmark.parse_runners(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(commands: Any) -> None:
    """Add the ``bench`` subcommand to ``commands`` (the top-level parser's subparsers)."""
    names = ", ".join(benchmark.RUNNERS)
    bench = commands.add_parser(
        "bench",
        help="measure envfleet against a for-loop, the ceiling and peer libraries",
        description=(
            "Measure, side by side in one run, the throughput of a for-loop, independent "
            "processes (the ceiling), envfleet's backends and the peer libraries that are "
            "installed, for each of a list of env counts. Random actions; the windows of the "
            "runners are interleaved and the median is reported. Prints a table and writes "
            "DIR/bench.json and DIR/bench.png (throughput against num_envs). Runners not "
            "installed are left out of the table and listed as such in the JSON."
        ),
        epilog="runners: "
        + "; ".join(f"{kind.name}: {kind.description}" for kind in benchmark.RUNNERS.values()),
        allow_abbrev=False,
    )
    bench.add_argument(
        "env",
        metavar="ENV",
        help="a registered env id, e.g. CartPole-v1, or module:Env-v0 to import module first",
    )
    bench.add_argument(
        "--num-envs",
        type=_num_envs_list,
        metavar="N[,N...]",
        help=(
            "env counts to sweep, comma-separated (default: "
            f"{','.join(map(str, DEFAULT_BENCH_NUM_ENVS))}; with --quick: "
            f"{','.join(map(str, QUICK_NUM_ENVS))})"
        ),
    )
    bench.add_argument(
        "--runners",
        type=_runner_list,
        metavar="NAME[,NAME...]",
        help=f"comma-separated, from {names} (default: all; with --quick: "
        f"{','.join(QUICK_RUNNERS)})",
    )
    bench.add_argument(
        "--seconds",
        type=positive_float,
        help=f"length of each timed window (default: {DEFAULT_BENCH_SECONDS:g}; with --quick: "
        f"{QUICK_SECONDS:g})",
    )
    bench.add_argument(
        "--startup-limit",
        type=positive_float,
        default=DEFAULT_STARTUP_LIMIT,
        metavar="SECONDS",
        help=(
            "a runner that takes longer to start is stopped and reported as skipped, also at "
            "larger env counts; one whose start-up at a smaller count, in proportion to the "
            f"envs, is well over it is not started (default: {DEFAULT_STARTUP_LIMIT:g})"
        ),
    )
    bench.add_argument(
        "--repeats",
        type=positive_int,
        help="timed windows per runner and env count; the median is reported (default: "
        f"{DEFAULT_BENCH_REPEATS}; with --quick: {QUICK_REPEATS})",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help=(
            "a first look in seconds rather than minutes: "
            f"--num-envs {','.join(map(str, QUICK_NUM_ENVS))} --runners "
            f"{','.join(QUICK_RUNNERS)} --seconds {QUICK_SECONDS:g} --repeats {QUICK_REPEATS} "
            "(each of these given beside --quick wins)"
        ),
    )
    bench.add_argument(
        "--vectorization-mode",
        choices=("none", "vector_entry_point"),
        default="none",
        help="'vector_entry_point': measure the env's own batched VectorEnv hosted by envfleet "
        "against it alone, its ceiling and envfleet's single envs (runners "
        f"{','.join(HOSTED_RUNNERS)} unless --runners is given); default: none",
    )
    bench.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds resets and actions (default: 0)"
    )
    bench.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=DEFAULT_BENCH_OUT,
        help=f"folder for bench.json and bench.png, made if missing (default: {DEFAULT_BENCH_OUT})",
    )
    bench.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout, nothing else"
    )
    bench.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    add_import_argument(bench)
    bench.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    bench.set_defaults(handler=_cmd_bench)


def _check_builds(spec: EnvSpec) -> None:
    try:
        env = spec.build()
    except Exception as exc:
        raise CliError(f"building {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    env.close()


def fill_defaults(args: argparse.Namespace) -> None:
    """The options not given: ``--quick``'s where it is given, the full run's otherwise."""
    quick = bool(args.quick)
    if args.vectorization_mode == "vector_entry_point" and args.runners is None:
        args.runners = list(HOSTED_RUNNERS)
        args.quick_runners = True  # the mode's runners, not the caller's
    if args.num_envs is None:
        args.num_envs = list(QUICK_NUM_ENVS if quick else DEFAULT_BENCH_NUM_ENVS)
    if args.runners is None and quick:
        args.runners = [name for name in QUICK_RUNNERS if name in benchmark.RUNNERS]
        args.quick_runners = True
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if quick else DEFAULT_BENCH_SECONDS
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if quick else DEFAULT_BENCH_REPEATS


def _cmd_bench(args: argparse.Namespace) -> int:
    fill_defaults(args)
    spec = env_spec(args.env)
    if args.vectorization_mode == "vector_entry_point" and not has_vector_entry_point(spec):
        raise UsageError(
            f"--vectorization-mode vector_entry_point: {args.env} has no vector entry point "
            "(a registered id with no wrappers that gymnasium.make_vec can build batched)"
        )
    names: list[str] = args.runners or list(benchmark.RUNNERS)
    explicit = args.runners is not None and not getattr(args, "quick_runners", False)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    # Libraries and envs print banners and warnings (ale-py, legacy gym in each of SB3's
    # processes, Ray): into bench.log, off the screen.
    with OutputCapture() as captured, contextlib.ExitStack() as stack:
        stderr, live = progress_console(args, captured.stderr)
        quiet = args.json or args.quiet

        def stage(text: str) -> None:
            print(text, file=stderr.file, flush=True)

        say: Callable[[str], object]
        if live:
            status = stack.enter_context(stderr.status(f"{spec.name}: starting"))

            def say(text: str) -> None:
                status.update(Text(text))

        else:  # piped: a line per stage, unless asked to be quiet
            say = (lambda text: None) if quiet else stage
        # Said at once: importing the peer libraries (torch for SB3, Ray) takes seconds.
        say(f"{spec.name}: checking which of {len(names)} runners can run here")
        available = {name: benchmark.availability(name, spec) for name in names}
        if not any(a.ok for a in available.values()):
            reasons = "; ".join(f"{name}: {a.reason}" for name, a in available.items())
            raise CliError(f"none of the runners asked for can run here ({reasons})")
        say(f"{spec.name}: building one env")
        _check_builds(spec)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot make the folder {out}: {exc.strerror or exc}") from exc

        timing = benchmark.Timing.scaled(
            args.seconds, args.repeats, seed=args.seed, startup_limit=args.startup_limit
        )

        def on_error(name: str, num_envs: int, exc: BaseException) -> None:
            if args.debug:
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=stderr.file)
            stderr.print(
                f"{PROG}: {name} failed with {num_envs} envs: "
                + one_line(f"{type(exc).__name__}: {exc}"),
                markup=False,
                soft_wrap=True,
            )

        report = benchmark.sweep(
            spec,
            args.num_envs,
            names,
            timing,
            on_error=on_error,
            progress=say if live else None,
            on_stage=None if live or quiet else stage,
        )
    stderr, _ = progress_console(args)
    log_path = out / "bench.log"
    if captured.text:
        try:
            log_path.write_text(captured.text)
        except OSError:
            pass

    json_path, png_path = out / "bench.json", out / "bench.png"
    try:
        benchmark.write_plot(report, png_path)
        document = benchmark.write_json(
            report,
            json_path,
            files={
                "json": str(json_path),
                "png": str(png_path),
                **({"log": str(log_path)} if captured.text else {}),
            },
        )
    except OSError as exc:
        raise CliError(f"writing the results to {out} failed: {exc.strerror or exc}") from exc
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    else:
        console = Console(highlight=False)
        print_whole(console, benchmark.report_table(report), benchmark.startup_table(report))
        for note in benchmark.report_notes(report):
            console.print(note, markup=False, soft_wrap=True)
        if captured.text:
            lines = len(captured.text.splitlines())
            console.print(
                f"{lines} line{'s' * (lines != 1)} printed by libraries and envs: {log_path}",
                markup=False,
                soft_wrap=True,
            )
        skipped = [n for n in names if not available[n].ok]
        if explicit and skipped:
            console.print(
                "skipped: " + "; ".join(f"{n} ({available[n].reason})" for n in skipped),
                markup=False,
                soft_wrap=True,
            )
        console.print(
            f"results written to {json_path} and {png_path}", markup=False, soft_wrap=True
        )

    if report.interrupted:
        stderr.print(
            f"{PROG}: interrupted; what was measured is in {json_path}",
            markup=False,
            soft_wrap=True,
        )
        return EXIT_INTERRUPTED
    errors = report.errors()
    if errors:
        described = "; ".join(
            f"{name} ({', '.join(f'{n} envs' for n in points)})" for name, points in errors.items()
        )
        raise CliError(
            f"{len(errors)} runner{'s' if len(errors) > 1 else ''} failed: {described}; "
            f"the messages are in {json_path}"
        )
    return EXIT_OK


__all__ = [
    "DEFAULT_BENCH_NUM_ENVS",
    "DEFAULT_BENCH_OUT",
    "DEFAULT_BENCH_REPEATS",
    "DEFAULT_BENCH_SECONDS",
    "DEFAULT_STARTUP_LIMIT",
    "QUICK_NUM_ENVS",
    "QUICK_REPEATS",
    "QUICK_RUNNERS",
    "QUICK_SECONDS",
    "add_parser",
    "fill_defaults",
]
