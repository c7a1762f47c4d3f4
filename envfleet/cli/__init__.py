"""The ``envfleet`` command line: ``run``, ``bench`` and ``tune``.

* ``envfleet run ENV`` steps copies of an env with a policy and reports throughput and
  episode returns (:mod:`envfleet.cli.run`; the loop: :mod:`envfleet.cli.runner`; the
  ``--out`` rollout file: :mod:`envfleet.cli.recorder`);
* ``envfleet bench ENV`` measures envfleet against a for-loop, the independent-processes
  ceiling and the peer libraries that are installed (:mod:`envfleet.cli.bench`);
* ``envfleet tune ENV`` probes an env and times a few pool layouts to find the fastest
  (:mod:`envfleet.cli.tune`; timing them within the budget: :mod:`envfleet.cli.layout_timing`).

This module builds the parser and runs :func:`main` (``envfleet``, ``python -m envfleet``: see
:mod:`envfleet.__main__`, which first checks that the ``cli`` extra is installed); what the
subcommands share (errors, exit statuses, argument types, ``--import``, capturing what libraries
print) is in :mod:`envfleet.cli.common`. Before a subcommand runs, the current directory goes on
the import path, as ``python -m`` puts it, and the ``--import`` modules are imported, so that
envs the user's own modules register are found.

Errors are reported as one ``envfleet: error: ...`` line on stderr, exit status 2 for bad
input (arguments, unknown env id, a policy that cannot be imported) and 1 for failures while
running (for ``bench``: a runner that failed, after the results are written); ``--debug`` adds
the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

import envfleet
from envfleet.cli import bench, run, tune
from envfleet.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    Parser,
    UsageError,
    current_directory_on_path,
    import_modules,
    one_line,
)
from envfleet.cli.layout_timing import TUNE_MIN_WINDOW, LayoutTiming, tune_layouts
from envfleet.cli.recorder import Recorder
from envfleet.cli.runner import (
    EpisodeTracker,
    LiveDisplay,
    PolicyError,
    RandomPolicy,
    RunLoop,
    RunSummary,
    load_policy,
)
from envfleet.errors import EnvError, PoolStateError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "TUNE_MIN_WINDOW",
    "CliError",
    "EpisodeTracker",
    "LayoutTiming",
    "LiveDisplay",
    "PolicyError",
    "RandomPolicy",
    "Recorder",
    "RunLoop",
    "RunSummary",
    "UsageError",
    "build_parser",
    "load_policy",
    "main",
    "tune_layouts",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``envfleet`` parser: one subparser per command (``run``, ``bench``, ``tune``)."""
    parser = Parser(
        prog=PROG,
        description="Run many copies of a Gymnasium environment in parallel.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {envfleet.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run.add_parser(commands)
    bench.add_parser(commands)
    tune.add_parser(commands)
    return parser


def _report(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {one_line(message)}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None, *, announced: bool = False) -> int:
    """Run the ``envfleet`` command line; return the exit status.

    ``announced``: ``run``'s ``starting`` line is out already (:mod:`envfleet.__main__`
    printed it), not to be printed again.
    """
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # name the subcommand's help, where its options are listed
            raise UsageError(
                f"unrecognized arguments: {' '.join(unknown)} (see '{PROG} {args.command} --help')"
            )
    except UsageError as exc:
        _report(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version print, then exit 0
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    debug = bool(getattr(args, "debug", False))
    handler: Callable[[argparse.Namespace], int] = args.handler
    args.announced = announced
    try:
        current_directory_on_path()
        import_modules(args.imports)
        return handler(args)
    except KeyboardInterrupt as exc:
        return _fail(exc, "interrupted", EXIT_INTERRUPTED, debug)
    except UsageError as exc:
        return _fail(exc, str(exc), EXIT_USAGE, debug)
    except (CliError, EnvError, PoolStateError) as exc:
        return _fail(exc, str(exc), EXIT_FAILURE, debug)
    except Exception as exc:
        return _fail(exc, f"{type(exc).__name__}: {exc}", EXIT_FAILURE, debug)


def _fail(exc: BaseException, message: str, status: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    _report(message)
    return status
