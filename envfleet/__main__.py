"""``python -m envfleet``: the ``envfleet`` command line (also the console script's entry).

The command line needs the ``cli`` extra (rich for its tables and progress, matplotlib for
``bench``'s plot). Without it, ``envfleet --help`` (and ``-h``, no arguments, ``--version``)
still answers, from what this module knows without importing the command line: the commands,
and the ``pip install`` that brings them; any other command says which ``pip install`` to run
instead of failing on an import.

``envfleet run`` prints its ``starting`` line from here, before the command line is imported,
where :func:`envfleet._starting.early_starting_line` can tell the input is good.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from envfleet._run_args import PROG
from envfleet._starting import early_starting_line

CLI_PACKAGES = ("rich", "matplotlib")
"""What ``envfleet[cli]`` installs on top of the library (see ``pyproject.toml``)."""

COMMANDS = {
    "run": "step an environment with a policy and report throughput and returns",
    "bench": "measure envfleet against a for-loop, the ceiling and peer libraries",
    "tune": "measure an environment and find the fastest pool layout for it",
}
"""The subcommands and their one-line help, as ``envfleet --help`` lists them (a test checks
that the parser of :mod:`envfleet.cli` says the same)."""

HELP_FLAGS = ("-h", "--help")


def missing_cli_packages() -> list[str]:
    """The packages of the ``cli`` extra that are not installed."""
    return [name for name in CLI_PACKAGES if importlib.util.find_spec(name) is None]


def help_without_cli(missing: Sequence[str]) -> str:
    """``envfleet --help`` where the ``cli`` extra is not installed."""
    from envfleet import __version__

    width = max(map(len, COMMANDS))
    commands = "".join(f"  {name:<{width}}  {text}\n" for name, text in COMMANDS.items())
    return (
        "usage: envfleet [-h] [--version] COMMAND ...\n\n"
        "Run many copies of a Gymnasium environment in parallel.\n\n"
        f"commands:\n{commands}\n"
        f"These commands need the cli extra, which is not installed (missing: "
        f"{', '.join(missing)}):\n"
        "  pip install 'envfleet[cli]'\n"
        "The library itself works without it: import envfleet; envfleet.make(...)\n"
        f"(envfleet {__version__})\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envfleet`` command line; return the exit status."""
    missing = missing_cli_packages()
    if missing:
        args = list(sys.argv[1:] if argv is None else argv)
        if args == ["--version"]:
            from envfleet import __version__

            sys.stdout.write(f"envfleet {__version__}\n")
            return 0
        if not args or any(arg in HELP_FLAGS for arg in args):
            sys.stdout.write(help_without_cli(missing))
            return 0 if args else 2
        sys.stderr.write(
            f"envfleet: error: the command line needs {', '.join(missing)}: "
            "pip install 'envfleet[cli]'\n"
        )
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    # ``run`` says what it starts before the command line's imports (Gymnasium, numpy, rich:
    # most of a second on a busy machine), where its input is known to be good without them.
    starting = early_starting_line(args)
    if starting is not None:
        sys.stderr.write(f"{PROG}: {starting}\n")
        sys.stderr.flush()
    from envfleet.cli import main as cli_main

    return cli_main(args, announced=starting is not None)


__all__ = [
    "CLI_PACKAGES",
    "COMMANDS",
    "HELP_FLAGS",
    "help_without_cli",
    "main",
    "missing_cli_packages",
]

if __name__ == "__main__":
    sys.exit(main())
