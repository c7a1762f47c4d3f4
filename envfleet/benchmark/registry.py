"""Every runner by name (:data:`RUNNERS`), the names accepted for them, and whether each can run
an env here (:func:`availability`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from envfleet.benchmark.bare import BARE_POOL, open_bare_pool
from envfleet.benchmark.base import (
    CEILING,
    LOOP,
    NOT_INSTALLED,
    OK,
    UNAVAILABLE,
    UNSUPPORTED,
    Runner,
    Timing,
    Workload,
)
from envfleet.benchmark.peers import (
    _ale_vector_check,
    _envpool_check,
    _quiet,
    open_ale_vector,
    open_envpool,
    open_pufferlib,
    open_sb3,
)
from envfleet.benchmark.runners import (
    envfleet_opener,
    open_ceiling,
    open_gym_async,
    open_gym_sync,
    open_loop,
)
from envfleet.spec import EnvSpec


@dataclass(frozen=True)
class RunnerKind:
    """A runner by name.

    Attributes:
        name: the name on the command line and in results.
        description: one line, for help and reports.
        open: builds, resets and warms it up on a workload.
        module: a module that must import for the runner to be available (a peer library).
        check: why an env cannot run on this runner, or ``None`` when it can.
        extra: the ``envfleet[...]`` extra that installs ``module``, named when it is missing.
    """

    name: str
    description: str
    open: Callable[[Workload, Timing], Runner]
    module: str | None = None
    check: Callable[[EnvSpec], str | None] | None = None
    extra: str | None = None


RUNNERS: dict[str, RunnerKind] = {
    kind.name: kind
    for kind in (
        RunnerKind(LOOP, "Python for-loop over the envs in this process", open_loop),
        RunnerKind(CEILING, "one independent process per core, throughputs summed", open_ceiling),
        RunnerKind(BARE_POOL, "one byte in, a loop over the envs, one byte out", open_bare_pool),
        RunnerKind("serial", "envfleet, serial backend", envfleet_opener("serial")),
        RunnerKind("process", "envfleet, process backend", envfleet_opener("process")),
        RunnerKind("thread", "envfleet, thread backend", envfleet_opener("thread")),
        RunnerKind("gym-sync", "Gymnasium SyncVectorEnv", open_gym_sync),
        RunnerKind("gym-async", "Gymnasium AsyncVectorEnv (shared memory)", open_gym_async),
        RunnerKind(
            "sb3", "Stable-Baselines3 SubprocVecEnv", open_sb3, "stable_baselines3", extra="sb3"
        ),
        RunnerKind("envpool", "EnvPool", open_envpool, "envpool", _envpool_check, "peers"),
        RunnerKind(
            "pufferlib",
            "PufferLib Multiprocessing",
            open_pufferlib,
            "pufferlib.vector",
            extra="peers",
        ),
        RunnerKind(
            "ale-vector",
            "ale-py AtariVectorEnv (C++ threads, the id's frames and frame skip)",
            open_ale_vector,
            "ale_py.vector_env",
            _ale_vector_check,
            "atari",
        ),
    )
}
"""Every runner by name, in the order they are run and shown."""

ALIASES = {
    "for-loop": LOOP,
    "envfleet-serial": "serial",
    "envfleet-process": "process",
    "envfleet-thread": "thread",
}
"""Longer names (``envfleet-process``) also accepted by :func:`parse_runners`."""


def parse_runners(text: str) -> list[str]:
    """``"loop,process"`` as runner names (aliases resolved, duplicates dropped, in order).

    Raises:
        ValueError: a name is unknown, or none is given; the message lists the known ones.
    """
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        name = ALIASES.get(name, name)
        if name not in RUNNERS:
            raise ValueError(f"unknown runner {raw.strip()!r}: choose from {', '.join(RUNNERS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no runner given: choose from {', '.join(RUNNERS)}")
    return names


@dataclass(frozen=True)
class Availability:
    """Whether a runner can run an env here, and why not."""

    status: str  # OK, NOT_INSTALLED, UNAVAILABLE or UNSUPPORTED
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK


def availability(name: str, spec: EnvSpec) -> Availability:
    """Whether runner ``name`` is installed here and can run ``spec``'s env."""
    kind = RUNNERS[name]
    if kind.module is not None:
        try:
            with _quiet():
                importlib.import_module(kind.module)
        except ModuleNotFoundError as exc:
            root = kind.module.split(".")[0]
            if exc.name is not None and (exc.name == root or kind.module.startswith(exc.name)):
                install = f": pip install 'envfleet[{kind.extra}]'" if kind.extra else ""
                return Availability(NOT_INSTALLED, f"{root} is not installed{install}")
            return Availability(UNAVAILABLE, f"importing {kind.module} failed: {exc}")
        except Exception as exc:
            return Availability(
                UNAVAILABLE, f"importing {kind.module} failed: {type(exc).__name__}: {exc}"
            )
    if kind.check is not None:
        try:
            reason = kind.check(spec)
        except Exception as exc:
            return Availability(UNAVAILABLE, f"{type(exc).__name__}: {exc}")
        if reason is not None:
            return Availability(UNSUPPORTED, reason)
    return Availability(OK)
