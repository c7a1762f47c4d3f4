"""What the ``envfleet`` subcommands share: exit statuses, errors, argument types, consoles.

Errors raised by a subcommand are reported by :func:`envfleet.cli.main` as one
``envfleet: error: ...`` line: :class:`UsageError` with exit status 2, any other
:class:`CliError` with exit status 1. ``IntArray`` and ``BoolArray`` type the per-step
columns that :mod:`envfleet.cli.runner` hands to :mod:`envfleet.cli.recorder`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import numpy.typing as npt
from rich.console import Console

from envfleet.spec import EnvSpec

PROG = "envfleet"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class CliError(Exception):
    """A failure while running: reported on one line, exit status 1."""


class UsageError(CliError):
    """Bad input from the user: reported on one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Argument parsing


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


def current_directory_on_path() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does (the console
    script does not), so that ``mysim:MySim-v0``, ``--import`` and ``--policy`` find the
    user's modules."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_modules(names: list[str]) -> None:
    """Import the ``--import`` modules; one that cannot be imported is a usage error."""
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (name + ".").startswith(exc.name + "."):
                raise UsageError(
                    f"--import {name}: no module named {exc.name!r} (not installed, and not "
                    f"found under the current directory {os.getcwd()})"
                ) from exc
            raise CliError(f"--import {name}: importing it failed: {exc}") from exc
        except Exception as exc:
            raise CliError(
                f"--import {name}: importing it failed: {type(exc).__name__}: {exc}"
            ) from exc


def env_spec(env: str) -> EnvSpec:
    """The env named on the command line; an unknown id is a usage error."""
    try:
        return EnvSpec.from_user(env)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


# ---------------------------------------------------------------------------------------------
# Console output


def progress_console(args: argparse.Namespace) -> tuple[Console, bool]:
    """The stderr console, and whether to show live progress on it."""
    stderr = Console(stderr=True, highlight=False)
    live = not (args.json or args.quiet) and stderr.is_terminal and not stderr.is_dumb_terminal
    return stderr, live


def one_line(text: str) -> str:
    """``text`` with its lines stripped and joined by spaces (for one-line error reports)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())
