"""The ``run`` command's arguments, with the standard library only.

``envfleet run`` says what it starts (the env, its workers, a Ray to start) before anything
slow. Importing Gymnasium, numpy and rich takes longer than that promise allows, so what the
``starting`` line needs lives here, importable without them: the ``run`` parser
(:func:`add_run_parser`, used by :mod:`envfleet.cli.run` too), its argument types and quick
checks; the line itself is :mod:`envfleet._starting`'s.

What this module knows of the library without importing it (the backends, the default restart
limit) is checked against the library by the tests.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

PROG = "envfleet"

DEFAULT_STEPS = 100_000
DEFAULT_MAX_RESTARTS = 100
""":data:`envfleet.pool.DEFAULT_MAX_RESTARTS`."""

BACKENDS = ("serial", "thread", "process", "ray")
"""The values of :class:`envfleet.Backend`, in order."""


class CliError(Exception):
    """A failure while running: reported on one line, exit status 1."""


class UsageError(CliError):
    """Bad input from the user: reported on one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum`` (``what`` names it in errors)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "a non-negative integer")


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def cpu_affinity(text: str) -> str | list[int] | list[list[int]]:
    """``--cpu-affinity``: ``spread``, ``0,1`` (one set for every worker) or ``0;1`` (a set per
    worker); :func:`envfleet.make` checks the CPUs themselves."""
    if text == "spread":
        return text
    try:
        sets = [[int(cpu) for cpu in part.split(",")] for part in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'spread', CPU ids like '0,1', or per-worker sets like '0;1', got {text!r}"
        ) from None
    return sets[0] if len(sets) == 1 else sets


def add_import_argument(parser: argparse.ArgumentParser) -> None:
    """``--import MODULE`` (repeatable): modules that register envs, imported before ENV is
    looked up."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=(
            "import MODULE first (repeatable), e.g. a module of yours that registers ENV with "
            "gymnasium.register; the current directory is searched first, as by python -m"
        ),
    )


def add_run_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``commands`` (the top-level parser's subparsers) and
    return its parser (without a handler: :mod:`envfleet.cli.run` sets it)."""
    run: argparse.ArgumentParser = commands.add_parser(
        "run",
        help="step an environment with a policy and report throughput and returns",
        description=(
            "Step NUM_ENVS copies of ENV with a policy (random by default), show live progress "
            "on stderr and print a summary. Episodes are counted per env under Gymnasium's "
            "NEXT_STEP autoreset (the reset step after an episode is part of no episode)."
        ),
        allow_abbrev=False,
    )
    run.add_argument(
        "env",
        metavar="ENV",
        help="a registered env id, e.g. CartPole-v1, or module:Env-v0 to import module first",
    )
    run.add_argument("--num-envs", type=positive_int, default=8, help="number of envs (default: 8)")
    run.add_argument(
        "--backend",
        type=str.lower,  # as envfleet.make takes backend="Process"
        choices=BACKENDS,
        default="process",
        help="where the envs run, in any case (default: process)",
    )
    run.add_argument(
        "--num-workers",
        type=positive_int,
        help="worker processes (process backend; default: usable cores, at most NUM_ENVS)",
    )
    run.add_argument(
        "--batch-size",
        type=positive_int,
        help="envs per batch; below NUM_ENVS runs asynchronously (default: NUM_ENVS)",
    )
    run.add_argument(
        "--seed", type=non_negative_int, default=0, help="env i is seeded seed+i (default: 0)"
    )
    run.add_argument(
        "--threads-per-worker",
        type=positive_int,
        default=1,
        help="step each worker's envs on this many threads (process and ray backends; for "
        "envs that sleep or release the GIL; default: 1)",
    )
    run.add_argument(
        "--vectorization-mode",
        choices=("none", "vector_entry_point"),
        default="none",
        help="'vector_entry_point': each worker hosts the env's own batched VectorEnv for its "
        "block of envs (gymnasium.make_vec's mode: CartPole-v1's numpy env, ale-py's "
        "AtariVectorEnv for ALE/*); default: none (single envs)",
    )
    run.add_argument(
        "--cpu-affinity",
        type=cpu_affinity,
        metavar="CPUS",
        help="pin the workers: 'spread' (worker w on the w-th usable CPU), '1' or '0,1' (every "
        "worker on those CPUs), '0;1' (worker w on entry w, cycled); default: no pinning",
    )
    run.add_argument(
        "--on-error",
        choices=["raise", "restart"],
        default="raise",
        help="an env that raises, dies or hangs stops the run (raise, the default) or is "
        "rebuilt and its episode reported truncated (restart)",
    )
    run.add_argument(
        "--step-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="a worker with no reply within this many seconds counts as hung and is killed "
        "(process and ray backends)",
    )
    run.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=DEFAULT_MAX_RESTARTS,
        help=f"restarts allowed per env under --on-error restart (default: {DEFAULT_MAX_RESTARTS})",
    )
    run.add_argument(
        "--address",
        help="ray backend: the cluster to join ('auto', 'ray://host:port'); default: the local "
        "Ray, started for the run",
    )
    limit = run.add_mutually_exclusive_group()
    limit.add_argument(
        "--steps",
        type=positive_int,
        help=f"run until at least this many env-steps (default: {DEFAULT_STEPS:_})",
    )
    limit.add_argument("--seconds", type=positive_float, help="run for this many seconds")
    run.add_argument(
        "--policy",
        metavar="MODULE:FUNCTION",
        help=(
            "a function called with a batch of observations that returns a batch of actions "
            "(default: random actions, seeded); MODULE is imported from the current directory "
            "or the installed packages"
        ),
    )
    run.add_argument(
        "--out", metavar="FILE.npz", type=Path, help="save the rollout to this .npz file"
    )
    run.add_argument(
        "--save-obs", action="store_true", help="also save observations in --out (large)"
    )
    run.add_argument(
        "--json", action="store_true", help="print the summary as JSON on stdout, nothing else"
    )
    run.add_argument(
        "-q", "--quiet", action="store_true", help="no live progress (the summary still prints)"
    )
    run.add_argument(
        "--stats",
        action="store_true",
        help=(
            "show the pool's per-worker statistics at the end: step latency p50/p99, idle "
            "fraction, steps, episodes, restarts (also under 'stats' in --json)"
        ),
    )
    add_import_argument(run)
    run.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    run.add_argument(
        "--verbose",
        action="store_true",
        help="also show the notices and warnings libraries and Ray print (hidden by default)",
    )
    return run


def check_run_args(args: argparse.Namespace) -> None:
    """The checks on ``run``'s arguments that need nothing imported; fills in ``--steps``."""
    if args.batch_size is not None and args.batch_size > args.num_envs:
        raise UsageError(
            f"--batch-size {args.batch_size} exceeds --num-envs {args.num_envs}: "
            "a batch holds at most every env"
        )
    if args.num_workers is not None and args.num_workers > args.num_envs:
        raise UsageError(
            f"--num-workers {args.num_workers} exceeds --num-envs {args.num_envs}: "
            "each worker needs at least one env"
        )
    if args.save_obs and args.out is None:
        raise UsageError("--save-obs needs --out FILE.npz")
    if args.steps is None and args.seconds is None:
        args.steps = DEFAULT_STEPS


def out_path(out: Path) -> Path:
    """``out`` with the ``.npz`` suffix numpy would add; its folder must exist."""
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder")
    return out


__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_STEPS",
    "PROG",
    "CliError",
    "Parser",
    "UsageError",
    "add_import_argument",
    "add_run_parser",
    "check_run_args",
    "cpu_affinity",
    "int_at_least",
    "non_negative_int",
    "out_path",
    "positive_float",
    "positive_int",
]
