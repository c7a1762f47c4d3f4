"""What the ``envfleet`` subcommands share: exit statuses, errors, argument types, consoles.

Errors raised by a subcommand are reported by :func:`envfleet.cli.main` as one
``envfleet: error: ...`` line: :class:`UsageError` with exit status 2, any other
:class:`CliError` with exit status 1. ``IntArray`` and ``BoolArray`` type the per-step
columns that :mod:`envfleet.cli.runner` hands to :mod:`envfleet.cli.recorder`.
"""

from __future__ import annotations

import argparse
import math
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
