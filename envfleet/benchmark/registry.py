"""Every runner by name (:data:`RUNNERS`), the names accepted for them, and whether each can run
an env here (:func:`availability`).

envfleet's own runners take ``make()`` options after their name, each ``:key=value`` (a Python
literal, else a string): ``process:batch_size=8``, ``thread:cpu_affinity=[1]``,
``process:num_workers=2:threads_per_worker=16`` (:func:`opener`).
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from envfleet.benchmark import bare, base, collect, peers, runners
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
        make: an envfleet runner's ``make()`` options (it then takes more after its name).
    """

    name: str
    description: str
    open: Callable[[base.Workload, base.Timing], base.Runner]
    module: str | None = None
    check: Callable[[EnvSpec], str | None] | None = None
    extra: str | None = None
    make: dict[str, Any] | None = None


def _envfleet(name: str, description: str, check: Any = None, **make: Any) -> RunnerKind:
    opener = runners.envfleet_opener(name=name, **make)
    return RunnerKind(name, description, opener, check=check, make=make)


def _rollouts(name: str, description: str, **make: Any) -> RunnerKind:
    """Hosted VectorEnvs collecting rollouts (:func:`~envfleet.benchmark.collect.open_rollouts`);
    like envfleet's stepping runners, it takes ``make()`` options after its name."""
    make = {"backend": "process", "vectorization_mode": "vector_entry_point", **make}
    opener = functools.partial(collect.open_rollouts, name=name, **make)
    return RunnerKind(name, description, opener, check=runners.vector_check, make=make)


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
            bare.BARE_POOL,
            "actions in shared memory, a loop over the envs, rows back, no more",
            bare.open_bare_pool,
        ),
        _envfleet("serial", "envfleet, serial backend", backend="serial"),
        _envfleet("process", "envfleet, process backend", backend="process"),
        _envfleet("thread", "envfleet, thread backend", backend="thread"),
        _envfleet(
            "hosted",
            "envfleet, process backend, each worker hosting the id's own VectorEnv",
            runners.vector_check,
            backend="process",
            vectorization_mode="vector_entry_point",
        ),
        _rollouts(
            "hosted-rollout",
            "hosted, each worker acting on its own (rollouts of 128 steps): no round trip a step",
        ),
        _rollouts(
            "hosted-rollout-unqueued",
            "hosted-rollout, each worker's next part sent only once its last is handed over",
            queue=False,
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
        RunnerKind(
            "vector-recording-ceiling",
            "vector-ceiling, each process acting and recording its steps as a rollout does",
            functools.partial(runners.CeilingRunner, recording=True),
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
        RunnerKind(
            "ale-hosted",
            "envfleet, process backend, a worker per core hosting ale-vector's AtariVectorEnv "
            "for its envs on one thread (ale-vector's threads in all)",
            peers.open_ale_hosted,
            "ale_py.vector_env",
            peers.ale_vector_check,
            "atari",
        ),
        RunnerKind(
            "ale-hosted-rollout",
            "ale-hosted, each worker acting on its own (rollouts of 128 steps)",
            collect.open_ale_hosted_rollouts,
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


def variant(name: str) -> tuple[RunnerKind, dict[str, Any]]:
    """A runner's kind and the ``make()`` options after its name (see the module docstring).

    Raises:
        ValueError: the kind is unknown, takes no options, or an option is not ``key=value``.
    """
    base_name, *options = name.split(":")
    base_name = ALIASES.get(base_name, base_name)
    if base_name not in RUNNERS:
        raise ValueError(f"unknown runner {base_name!r}: choose from {', '.join(RUNNERS)}")
    kind, given = RUNNERS[base_name], {}
    if options and kind.make is None:
        raise ValueError(f"{base_name} takes no options (envfleet's runners do): {name!r}")
    for option in options:
        key, equals, text = option.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"{name!r}: options are :key=value, got {option!r}")
        try:
            given[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            given[key] = text
    return kind, given


def opener(name: str) -> Callable[[base.Workload, base.Timing], base.Runner]:
    """What opens runner ``name``, a registered one or a variant (:func:`variant`)."""
    kind, given = variant(name)
    if not given:
        return kind.open
    made = cast(functools.partial[base.Runner], kind.open)  # an envfleet kind's: a partial
    return functools.partial(made.func, *made.args, **{**made.keywords, "name": name, **given})


def parse_runners(text: str) -> list[str]:
    """``"loop,process"`` as runner names (aliases resolved, duplicates dropped, in order);
    variants of envfleet's runners (``process:batch_size=8``) kept as given.

    Raises:
        ValueError: a name is unknown, or none is given; the message lists the known ones.
    """
    names: list[str] = []
    for raw in text.split(","):
        base_name, colon, options = raw.strip().partition(":")
        name = ALIASES.get(base_name, base_name) + colon + options
        if not name:
            continue
        variant(name)
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
    """Whether runner ``name`` (or a variant) is installed here and can run ``spec``'s env."""
    kind = variant(name)[0]
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


__all__ = [
    "RUNNERS",
    "Availability",
    "RunnerKind",
    "availability",
    "opener",
    "parse_runners",
    "variant",
]
