"""Measure an env and choose a pool layout: what ``envfleet tune`` and ``num_workers="auto"`` use.

This module never builds a pool (``envfleet.make`` imports it for ``num_workers="auto"``);
timing layouts with real pools is :mod:`envfleet.cli.layout_timing`'s job.

The probe builds one env in this process and steps it with random actions for a fraction of a
second. Two figures decide the layout: the step time (cheap envs want few workers with many envs
each, so signalling is amortised) and the CPU share of a step (``thread_time / wall time``): an
env that mostly waits (sleeps, I/O, a remote simulator) wants one thread per env, not one core.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import gymnasium
import numpy as np

from envfleet.affinity import usable_cpus
from envfleet.backends.contract.registry import Backend, Capabilities, kind_of
from envfleet.spec import EnvSpec

ASYNC_WORKERS_PER_CORE = 4
"""At most this many workers per core for an async pool of envs that wait: a worker steps its
envs one after another, so the envs of a worker come back no sooner than its slowest; more
workers (they mostly sleep) let the fast envs come back first (issue 23: heavy-tailed envs x 32,
``batch_size=8``, 2 cores: 1.2x sync on 2 workers, 2.4x on 8)."""

BLOCKING_STEPS = 0.5
"""An env that waits blocks its thread (sleep, I/O: a voluntary context switch) in at least
this share of its steps."""

WAITING_CPU_SHARE = 0.2
"""Below this share of CPU per step an env counts as waiting rather than computing (low: a
computing env on a busy machine still gets well over this share of a core)."""


@dataclass(frozen=True)
class EnvProfile:
    """What the probe measured of one env."""

    step_seconds: float
    step_cv: float  # coefficient of variation of the step time
    reset_seconds: float
    cpu_share: float  # CPU seconds per wall second while stepping
    observation_bytes: int
    blocks_per_step: float | None = None  # voluntary context switches per step (Linux)

    @property
    def waits(self) -> bool:
        """Whether the env spends most of a step waiting, not computing: a small share of CPU
        and, where the system counts them, the thread blocking in most steps (a computing env
        on a crowded machine also gets a small share, but is preempted, it does not block)."""
        if self.blocks_per_step is not None and self.blocks_per_step < BLOCKING_STEPS:
            return False
        return self.cpu_share < WAITING_CPU_SHARE

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "waits": self.waits}


@dataclass(frozen=True)
class Layout:
    """A way to run ``num_envs`` envs: the arguments of :func:`envfleet.make` it stands for.

    ``backend``: a :class:`Backend` (its name is accepted and turned into one).
    ``cpu_affinity``: ``"spread"`` or a tuple of CPU ids (a tuple, so that layouts hash).
    """

    backend: Backend
    num_workers: int
    threads_per_worker: int = 1
    batch_size: int | None = None
    cpu_affinity: str | tuple[int, ...] | None = None
    vectorization_mode: str | None = None
    """``"vector_entry_point"``: each worker hosts the env's own VectorEnv for its block."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):  # its name, at the edge
            object.__setattr__(self, "backend", Backend(self.backend))

    def make_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": self.backend.value, "num_workers": self.num_workers}
        if self.threads_per_worker > 1:
            kwargs["threads_per_worker"] = self.threads_per_worker
        if self.batch_size is not None:
            kwargs["batch_size"] = self.batch_size
        if self.cpu_affinity is not None:
            affinity = self.cpu_affinity
            kwargs["cpu_affinity"] = affinity if isinstance(affinity, str) else list(affinity)
        if self.vectorization_mode is not None:
            kwargs["vectorization_mode"] = self.vectorization_mode
        return kwargs

    def describe(self, env: str, num_envs: int) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.make_kwargs().items())
        return f"envfleet.make({env!r}, {num_envs}, {args})"


def has_vector_entry_point(spec: EnvSpec) -> bool:
    """Whether ``spec`` is a registered id (with no wrappers) that Gymnasium can build as its
    own batched VectorEnv (``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")``)."""
    target = spec.target
    if not isinstance(target, str) or spec.per_env or spec.wrappers or spec.legacy_gym:
        return False
    entry = gymnasium.registry.get(target)
    return entry is not None and entry.vector_entry_point is not None


def profile_env(spec: EnvSpec, seconds: float = 0.3, max_steps: int = 2000) -> EnvProfile:
    """Step one env built from ``spec`` for about ``seconds`` and measure it."""
    env = spec.build()
    try:
        env.action_space.seed(0)
        start = time.perf_counter()
        obs, _ = env.reset(seed=0)
        reset_seconds = time.perf_counter() - start
        durations: list[float] = []
        blocks0 = _blocks()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - wall0 < seconds and len(durations) < max_steps:
            action = env.action_space.sample()
            t = time.perf_counter()
            obs, _, terminated, truncated, _ = env.step(action)
            durations.append(time.perf_counter() - t)
            if terminated or truncated:
                env.reset()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        blocks1 = _blocks()
        mean = statistics.fmean(durations)
        return EnvProfile(
            step_seconds=mean,
            step_cv=statistics.pstdev(durations) / mean if mean > 0 else 0.0,
            reset_seconds=reset_seconds,
            cpu_share=min(1.0, cpu / wall) if wall > 0 else 1.0,
            observation_bytes=_nbytes(obs),
            blocks_per_step=(
                None if blocks0 is None or blocks1 is None else (blocks1 - blocks0) / len(durations)
            ),
        )
    finally:
        env.close()


def _blocks() -> int | None:
    """Voluntary context switches of this thread so far (``None``: not counted here)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)
    except (ImportError, AttributeError, OSError):
        return None


def _nbytes(obs: Any) -> int:
    if isinstance(obs, dict):
        return sum(_nbytes(v) for v in obs.values())
    if isinstance(obs, tuple):
        return sum(_nbytes(v) for v in obs)
    return int(np.asarray(obs).nbytes)


def auto_layout(
    profile: EnvProfile,
    backend: str | Backend,
    num_envs: int,
    cores: int,
    batch_size: int | None = None,
) -> Layout:
    """The layout ``num_workers="auto"`` picks for ``backend`` from a probe
    (:func:`choose_layout`)."""
    kind = Backend(backend)
    can = kind_of(kind).capabilities
    workers, threads, batched = choose_layout(profile, can, num_envs, cores, batch_size)
    return Layout(
        kind, workers, threads_per_worker=threads, batch_size=batch_size if batched else None
    )


def choose_layout(
    profile: EnvProfile,
    can: Capabilities,
    num_envs: int,
    cores: int,
    batch_size: int | None = None,
) -> tuple[int, int, bool]:
    """Workers, threads per worker, and whether the choice is for ``batch_size``, for a backend
    that can do ``can`` (:mod:`envfleet.backends.contract.registry`: asked, never its name).

    An async pool (``batch_size < num_envs``) of envs that wait gets workers enough that each
    holds at most half a batch (and at least one per core, at most
    :data:`ASYNC_WORKERS_PER_CORE` per core): its envs are stepped one after another, so a slow
    env holds back only those few.
    """
    workers = max(1, min(cores, num_envs))
    if can.one_worker:
        return 1, 1, False
    if can.worker_per_env:
        return (num_envs if profile.waits else workers), 1, False
    if profile.waits and batch_size is not None and batch_size < num_envs and can.local_cpus:
        per_worker = max(1, batch_size // 2)
        wanted = min(ASYNC_WORKERS_PER_CORE * cores, -(-num_envs // per_worker))
        return max(workers, min(num_envs, wanted)), 1, True
    if profile.waits and can.threads_per_worker:
        # Waiting envs overlap on threads; processes keep them isolated from each other.
        return workers, -(-num_envs // workers), False
    return workers, 1, False


def candidate_layouts(
    profile: EnvProfile,
    num_envs: int,
    cores: int,
    *,
    policy_in_loop: bool = False,
    hosted: bool = False,
) -> list[Layout]:
    """Layouts worth timing for ``envfleet tune`` (a handful, bounded by the time budget).

    ``policy_in_loop``: a policy runs between ``recv`` and ``send``; double-buffered async
    layouts (``batch_size = num_envs / 2``) overlap it with stepping, and one of them leaves a
    core to the policy (a worker fewer than cores). ``hosted``: the env has a vector entry
    point; layouts where each worker hosts it for its block of envs (one worker, one per core)
    join the candidates.
    """
    candidates: list[Layout] = []
    for workers in sorted({1, max(1, cores // 2), cores, min(num_envs, 2 * cores)}):
        if workers <= num_envs:
            candidates.append(Layout(Backend.PROCESS, workers))
    waiting = auto_layout(profile, Backend.PROCESS, num_envs, cores)
    candidates.append(waiting)
    candidates.append(Layout(Backend.THREAD, num_envs))
    if profile.waits and cores > 1 and hasattr(os, "sched_setaffinity"):
        # Threads of waiting envs hand the GIL over faster on one core (measured by a probe
        # script, bench/thread_bench.py, now in the git history).
        candidates.append(Layout(Backend.THREAD, num_envs, cpu_affinity=(usable_cpus()[-1],)))
        if waiting.threads_per_worker > 1:
            candidates.append(replace(waiting, cpu_affinity="spread"))
    candidates.append(Layout(Backend.SERIAL, 1))
    if num_envs >= 4:
        candidates.append(Layout(Backend.PROCESS, min(cores, num_envs), batch_size=num_envs // 2))
    if policy_in_loop and num_envs >= 2:
        half = num_envs // 2
        candidates.insert(0, Layout(Backend.PROCESS, min(cores, num_envs), batch_size=half))
        if cores > 1:
            candidates.insert(1, Layout(Backend.PROCESS, min(cores - 1, num_envs), batch_size=half))
    if hosted:  # the env's own batched simulator, one per worker: few workers, large blocks
        mode = "vector_entry_point"
        candidates.append(Layout(Backend.SERIAL, 1, vectorization_mode=mode))
        if cores > 1 and num_envs >= cores:
            candidates.append(Layout(Backend.PROCESS, cores, vectorization_mode=mode))
    unique: list[Layout] = []
    for layout in candidates:
        if layout not in unique:
            unique.append(layout)
    return unique


__all__ = [
    "ASYNC_WORKERS_PER_CORE",
    "BLOCKING_STEPS",
    "WAITING_CPU_SHARE",
    "EnvProfile",
    "Layout",
    "auto_layout",
    "candidate_layouts",
    "choose_layout",
    "has_vector_entry_point",
    "profile_env",
]
