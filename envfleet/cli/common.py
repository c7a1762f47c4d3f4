"""What the ``envfleet`` subcommands share: exit statuses, errors, argument types, consoles.

Errors raised by a subcommand are reported by :func:`envfleet.cli.main` as one
``envfleet: error: ...`` line: :class:`UsageError` with exit status 2, any other
:class:`CliError` with exit status 1. ``IntArray`` and ``BoolArray`` type the per-step
columns that :mod:`envfleet.cli.runner` hands to :mod:`envfleet.cli.recorder`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO, cast

import numpy as np
import numpy.typing as npt
from rich.console import Console, RenderableType
from rich.measure import Measurement

from envfleet._clock import clock as clock
from envfleet._run_args import PROG as PROG
from envfleet._run_args import CliError as CliError
from envfleet._run_args import Parser as Parser
from envfleet._run_args import UsageError as UsageError
from envfleet._run_args import add_import_argument as add_import_argument
from envfleet._run_args import int_at_least as int_at_least
from envfleet._run_args import non_negative_int as non_negative_int
from envfleet._run_args import positive_float as positive_float
from envfleet._run_args import positive_int as positive_int
from envfleet.spec import EnvSpec

_ColorSystem = Literal["standard", "256", "truecolor", "windows"] | None

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def current_directory_on_path() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does (the console
    script does not), so that ``mysim:MySim-v0``, ``--import`` and ``--policy`` find the
    user's modules."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_user_module(name: str, option: str) -> Any:
    """Import module ``name`` that option ``option`` (``"--import mysim"``) names.

    A module that is not there is a usage error naming the option and the current directory
    (which is on the path); one that fails while importing is an error with its exception.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name + ".").startswith(exc.name + "."):
            raise UsageError(
                f"{option}: no module named {exc.name!r} (not installed, and not found under "
                f"the current directory {os.getcwd()})"
            ) from exc
        raise CliError(f"{option}: importing {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise CliError(f"{option}: importing {name!r} failed: {type(exc).__name__}: {exc}") from exc


def import_modules(names: list[str]) -> None:
    """Import the ``--import`` modules; one that cannot be imported is a usage error."""
    for name in names:
        import_user_module(name, f"--import {name}")


def env_spec(env: str) -> EnvSpec:
    """The env named on the command line; an unknown id is a usage error."""
    try:
        return EnvSpec.from_user(env)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if message.endswith("no registered id is close to it") and ":" not in env:
            message += f" (registered by a module of yours? --import MODULE, or MODULE:{env})"
        raise UsageError(message) from exc


# ---------------------------------------------------------------------------------------------
# Console output


def progress_console(args: argparse.Namespace, file: TextIO | None = None) -> tuple[Console, bool]:
    """The stderr console (on ``file``, the real stderr while :class:`OutputCapture` holds
    fd 2, if given), and whether to show live progress on it."""
    stderr = (
        Console(stderr=True, highlight=False)
        if file is None
        else Console(file=file, highlight=False)
    )
    live = not (args.json or args.quiet) and stderr.is_terminal and not stderr.is_dumb_terminal
    return stderr, live


def print_whole(console: Console, *renderables: RenderableType) -> None:
    """Print ``renderables`` (tables of numbers) on ``console`` without cutting a cell.

    Rich fits a table into the console's width, shortening cells with "…" ("107,9…"): on a
    console narrower than the tables' natural width (output piped into a file or a program,
    which rich takes for 80 columns, or a narrow terminal), they are printed at their natural
    width instead, and a terminal wraps the long lines rather than any number losing digits.
    """
    wide = console.options.update_width(10_000)
    needed = max(
        (Measurement.get(console, wide, renderable).maximum for renderable in renderables),
        default=0,
    )
    if needed > console.width:
        console = Console(
            file=console.file,
            width=needed,
            highlight=False,
            # rich types the property as any str; it is one of the names the parameter takes
            color_system=cast(_ColorSystem, console.color_system),
            force_terminal=console.is_terminal,
        )
    for renderable in renderables:
        console.print(renderable)


class StageLog:
    """What a command is doing, one line per stage on stderr, at once: ``starting ...``,
    ``started ... in 3.8 s``, ``done ...``.

    On a terminal the lines come before and after the live display; piped into a file or a
    program, where there is no live display, :meth:`progress` adds a plain progress line at most
    every :attr:`interval` seconds, so that a log shows how far a long run is. ``enabled=False``
    (``--quiet``, ``--json``) prints nothing.
    """

    def __init__(self, console: Console, enabled: bool = True, interval: float = 10.0) -> None:
        self.console = console
        self.enabled = enabled
        self.interval = interval
        self.started = time.perf_counter()
        self._next_progress = time.perf_counter() + interval

    def line(self, text: str) -> None:
        """Print a stage line; the next progress line comes :attr:`interval` seconds after it."""
        self._next_progress = time.perf_counter() + self.interval
        if self.enabled:
            self.console.print(f"{PROG}: {text}", markup=False, highlight=False, soft_wrap=True)
            self.console.file.flush()

    def since(self) -> float:
        """Seconds since this log was made (the command's start)."""
        return time.perf_counter() - self.started

    def progress(self, text: Callable[[], str]) -> None:
        """A progress line, if :attr:`interval` seconds passed since the last one."""
        now = time.perf_counter()
        if self.enabled and now >= self._next_progress:
            self._next_progress = now + self.interval
            self.line(text())


BANNERS = (
    re.compile(r"^A\.L\.E: Arcade Learning Environment"),
    re.compile(r"^\[Powered by Stella\]"),
    re.compile(r"^Game console created:"),
    re.compile(r"Gym has been unmaintained since 2022"),
    re.compile(r"^Please upgrade to Gymnasium"),
    re.compile(r"^Users of this version of Gym should be able to simply replace"),
    re.compile(r"^See the migration guide at"),
    # Ray's notices and warnings as its logger formats them (errors still show).
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) \S+\.py:\d+ -- "),
    # ... and as its C++ core does (a GCS it cannot reach: a line every few seconds).
    re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [IW] \d+ \d+\] "),
)
"""Lines libraries print on import or start-up whatever happens (ale-py, legacy gym, Ray)."""


class OutputCapture:
    """Sends what is written to file descriptors 1 and 2 to a temporary file while active.

    That takes in what C code (ale-py's banner), Python's ``print`` and ``warnings``, and the
    child processes started meanwhile (workers, peers' subprocesses, Ray) print, which no
    ``sys.stdout`` swap could. :attr:`stderr` is a text stream on the real stderr, for the
    command's own progress and errors. Where fds 1 and 2 are not this process's
    ``sys.stdout``/``sys.stderr`` (under a test's capture), nothing is captured.

    Args:
        replay: at the end (even on an error), write what was captured, less the known
            banners (:data:`BANNERS`), to stderr.
        verbose: replay the known banners too (``--verbose``).
    """

    def __init__(self, replay: bool = False, verbose: bool = False) -> None:
        self.replay = replay
        self.verbose = verbose
        self.stderr: TextIO | None = None
        self.text = ""
        self._saved: list[int] = []
        self._log: Any = None

    @staticmethod
    def possible() -> bool:
        try:
            return sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):
            return False

    def __enter__(self) -> OutputCapture:
        if not self.possible():
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        self._log = tempfile.TemporaryFile(mode="w+b")
        self._saved = [os.dup(1), os.dup(2)]
        self.stderr = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        os.dup2(self._log.fileno(), 1)
        os.dup2(self._log.fileno(), 2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._saved:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = []
        if self.stderr is not None:
            self.stderr.close()
        self._log.seek(0)
        self.text = self._log.read().decode("utf-8", "replace")
        self._log.close()
        if self.replay and self.unexpected():
            sys.stderr.write(self.unexpected())
            sys.stderr.flush()

    def unexpected(self) -> str:
        """What was captured, less the known banners (:data:`BANNERS`)."""
        lines = self.text.splitlines(keepends=True)
        if self.verbose:
            return "".join(lines)
        return "".join(ln for ln in lines if not any(b.search(ln) for b in BANNERS))


def one_line(text: str) -> str:
    """``text`` with its lines stripped and joined by spaces (for one-line error reports)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


__all__ = [
    "BANNERS",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "BoolArray",
    "CliError",
    "IntArray",
    "OutputCapture",
    "Parser",
    "StageLog",
    "UsageError",
    "add_import_argument",
    "clock",
    "current_directory_on_path",
    "env_spec",
    "import_modules",
    "import_user_module",
    "int_at_least",
    "non_negative_int",
    "one_line",
    "positive_float",
    "positive_int",
    "print_whole",
    "progress_console",
]
