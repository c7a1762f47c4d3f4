"""Every runner by name (:data:`RUNNERS`), the names accepted for them, and whether each can run
an env here (:func:`availability`)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from envfleet.benchmark import bare, base, peers, runners
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
    open: Callable[[base.Workload, base.Timing], base.Runner]
    module: str | None = None
    check: Callable[[EnvSpec], str | None] | None = None
    extra: str | None = None


RUNNERS: dict[str, RunnerKind] = {
    kind.name: kind
    for kind in (
        RunnerKind(base.LOOP, "Python for-loop over the envs in this process", runners.open_loop),
        RunnerKind(
            base.CEILING,
            "one independent process per core, throughputs summed",
            runners.CeilingRunner,
        ),
        RunnerKind(
            bare.BARE_POOL, "one byte in, a loop over the envs, one byte out", bare.open_bare_pool
        ),
        RunnerKind("serial", "envfleet, serial backend", runners.envfleet_opener("serial")),
        RunnerKind("process", "envfleet, process backend", runners.envfleet_opener("process")),
        RunnerKind(
            "process-copy",
            "envfleet, process backend, observations copied by the pool (no spare rows)",
            runners.open_process_copy,
        ),
        RunnerKind("thread", "envfleet, thread backend", runners.envfleet_opener("thread")),
        RunnerKind(
            "hosted",
            "envfleet, process backend, each worker hosting the id's own VectorEnv",
            runners.envfleet_opener(
                "process", name="hosted", vectorization_mode="vector_entry_point"
            ),
            check=runners.vector_check,
        ),
        RunnerKind(
            "vector",
            "the id's own VectorEnv (its vector entry point), alone in this process",
            runners.open_vector_alone,
            check=runners.vector_check,
        ),
        RunnerKind(
            "vector-ceiling",
            "the id's own VectorEnv, one per core, never communicating, throughputs summed",
            functools.partial(runners.CeilingRunner, vectorized=True),
            check=runners.vector_check,
        ),
        RunnerKind("gym-sync", "Gymnasium SyncVectorEnv", runners.open_gym_sync),
        RunnerKind("gym-async", "Gymnasium AsyncVectorEnv (shared memory)", runners.open_gym_async),
        RunnerKind(
            "sb3",
            "Stable-Baselines3 SubprocVecEnv",
            peers.open_sb3,
            "stable_baselines3",
            extra="sb3",
        ),
        RunnerKind(
            "envpool", "EnvPool", peers.open_envpool, "envpool", peers.envpool_check, "peers"
        ),
        RunnerKind(
            "pufferlib",
            "PufferLib Multiprocessing",
            peers.open_pufferlib,
            "pufferlib.vector",
            extra="peers",
        ),
        RunnerKind(
            "ale-vector",
            "ale-py AtariVectorEnv (C++ threads, the id's frames and frame skip)",
            peers.open_ale_vector,
            "ale_py.vector_env",
            peers.ale_vector_check,
            "atari",
        ),
    )
}
"""Every runner by name, in the order they are run and shown."""

ALIASES = {
    "for-loop": base.LOOP,
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
        name = ALIASES.get(raw.strip(), raw.strip())
        if not name:
            continue
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

    status: str  # OK, NOT_INSTALLED, UNAVAILABLE or UNSUPPORTED (base)
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == base.OK


def availability(name: str, spec: EnvSpec) -> Availability:
    """Whether runner ``name`` is installed here and can run ``spec``'s env."""
    kind = RUNNERS[name]
    if kind.module is not None:
        try:
            with peers.quiet():
                importlib.import_module(kind.module)
        except ModuleNotFoundError as exc:
            root = kind.module.split(".")[0]
            if exc.name is not None and (exc.name == root or kind.module.startswith(exc.name)):
                install = f": pip install 'envfleet[{kind.extra}]'" if kind.extra else ""
                return Availability(base.NOT_INSTALLED, f"{root} is not installed{install}")
            return Availability(base.UNAVAILABLE, f"importing {kind.module} failed: {exc}")
        except Exception as exc:
            return Availability(
                base.UNAVAILABLE, f"importing {kind.module} failed: {type(exc).__name__}: {exc}"
            )
    if kind.check is not None:
        try:
            reason = kind.check(spec)
        except Exception as exc:
            return Availability(base.UNAVAILABLE, f"{type(exc).__name__}: {exc}")
        if reason is not None:
            return Availability(base.UNSUPPORTED, reason)
    return Availability(base.OK)


__all__ = ["ALIASES", "RUNNERS", "Availability", "RunnerKind", "availability", "parse_runners"]
