"""The ``starting`` line ``envfleet run`` prints first, with the standard library only.

:func:`starting_line` says what the run starts (the env, its workers, a Ray to start) from the
arguments alone, before anything slow. :func:`early_starting_line` lets
:mod:`envfleet.__main__` print it before it imports the command line, for input it can tell is
good (:func:`gymnasium_builtin_ids`, :func:`is_installed_ale_id`: read from the installed
packages' files, not imported); anything else goes to the command line, which reports bad input
as one error line before any ``starting`` line, as ever.

What this module knows of the library without importing it (what each backend runs its envs
on) is checked against the library by the tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

from envfleet._run_args import (
    PROG,
    Parser,
    UsageError,
    add_run_parser,
    check_run_args,
    out_path,
)

__all__ = [
    "early_starting_line",
    "gymnasium_builtin_ids",
    "is_installed_ale_id",
    "starting_line",
    "workers",
]

_ONE_WORKER = frozenset({"serial"})
_WORKER_PER_ENV = frozenset({"thread"})
"""The backends whose ``Capabilities`` say ``one_worker`` and ``worker_per_env``."""

_WORKER_NOUNS = {
    "serial": ("worker", "workers"),
    "thread": ("thread", "threads"),
    "process": ("worker process", "worker processes"),
    "ray": ("Ray actor", "Ray actors"),
}


def workers(backend: str, count: int) -> str:
    """``2 worker processes``, ``1 Ray actor``."""
    one, many = _WORKER_NOUNS[backend]
    return f"{count} {one if count == 1 else many}"


def starting_line(args: argparse.Namespace) -> str:
    """The first line ``run`` prints: the env, where its envs will run, what must start first.

    Worked out from the arguments alone (``envfleet.make``'s defaults), so that it is printed
    before anything slow: importing the env's modules, building it, starting workers or Ray.
    """
    backend = args.backend
    if backend in _ONE_WORKER:
        count = 1
    elif args.num_workers is not None:
        count = args.num_workers
    elif backend in _WORKER_PER_ENV:
        count = args.num_envs
    else:
        count = min(len(_usable_cpus()), args.num_envs)
    envs = f"{args.num_envs} env{'s' * (args.num_envs != 1)}"
    if backend == "serial":
        where = "in this process (serial backend)"
    else:
        where = f"on {workers(backend, count)}"
        if args.threads_per_worker > 1:
            where += f" x {args.threads_per_worker} threads"
    text = f"starting {args.env}: {envs} {where}"
    if backend == "ray":
        text += (
            ", after starting a local Ray (several seconds)"
            if args.address is None
            else f", joining the Ray at {args.address}"
        )
    limit = f"{args.steps:,} steps" if args.steps is not None else f"{args.seconds:g} s"
    return f"{text}; then {limit}"


def _usable_cpus() -> Sequence[int]:
    """:func:`envfleet.affinity.usable_cpus`."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return range(os.cpu_count() or 1)


_REGISTER_ID = re.compile(r"""\bregister\(\s*id\s*=\s*["']([^"']+)["']""")


def gymnasium_builtin_ids() -> frozenset[str]:
    """The ids Gymnasium registers whenever it is imported (``CartPole-v1``...), read from its
    ``gymnasium/envs/__init__.py`` without importing it; empty where that cannot be read."""
    try:
        spec = importlib.util.find_spec("gymnasium")
        if spec is None or not spec.submodule_search_locations:
            return frozenset()
        folder = Path(next(iter(spec.submodule_search_locations)))
        return frozenset(_REGISTER_ID.findall((folder / "envs" / "__init__.py").read_text()))
    except (OSError, ValueError, ImportError, UnicodeDecodeError):
        return frozenset()


_ALE_V5 = re.compile(r"ALE/([A-Z][A-Za-z0-9]*)-v5")
_ALE_MULTIPLAYER_ONLY = frozenset({"combat", "joust", "maze_craze", "warlords"})
"""ROMs ale_py registers no ``ALE/...-v5`` id for (no single-player mode)."""


def is_installed_ale_id(env_id: str) -> bool:
    """Whether ``env_id`` is an ``ALE/Name-v5`` id whose ROM the installed ale_py ships, told
    from ale_py's ``roms`` folder without importing it, naming each ROM as ale_py's
    registration does (``space_invaders.bin``: ``ALE/SpaceInvaders-v5``)."""
    match = _ALE_V5.fullmatch(env_id)
    if match is None:
        return False
    try:
        spec = importlib.util.find_spec("ale_py")
        if spec is None or not spec.submodule_search_locations:
            return False
        roms = Path(next(iter(spec.submodule_search_locations))) / "roms"
        return any(
            rom.stem.title().replace("_", "") == match.group(1)
            for rom in roms.glob("*.bin")
            if rom.stem not in _ALE_MULTIPLAYER_ONLY
        )
    except (OSError, ValueError, ImportError):
        return False


def early_starting_line(argv: Sequence[str]) -> str | None:
    """The ``starting`` line for ``envfleet ARGV``, where it is a ``run`` whose input is known
    to be good without importing anything: arguments that parse and pass the quick checks, no
    ``--import``, and an id that Gymnasium registers itself or an installed ale_py's
    ``ALE/Name-v5`` id (what ``make run`` steps). ``None`` otherwise (other
    commands, ``--help``, ``--quiet``/``--json``, bad or unknown input, an id a module
    registers): the command line then checks and says everything itself."""
    if not argv or argv[0] != "run" or any(arg in ("-h", "--help") for arg in argv):
        return None  # the command line prints the help, once
    parser = Parser(prog=PROG, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_run_parser(commands)
    try:
        args, unknown = parser.parse_known_args(list(argv))
        if unknown or args.quiet or args.json or args.imports:
            return None
        check_run_args(args)
        if args.out is not None:
            out_path(args.out)
    except (UsageError, SystemExit):  # reported (or the help printed) by the command line
        return None
    if args.env not in gymnasium_builtin_ids() and not is_installed_ale_id(args.env):
        return None
    return starting_line(args)
