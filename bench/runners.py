"""Throughput runners: each builds its envs, resets, warms up, then times stepping.

Every runner has the signature ``runner(workload, timing) -> RunResult`` and measures env-steps
per second (a vector step of ``n`` envs counts ``n``) with random actions sampled before the
clock starts and cycled, so sampling does not weigh on the result. Each repeat is a window of
``timing.seconds`` on the same envs; :attr:`RunResult.median` is what gets reported.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorEnv

import envfleet
from bench.envs import Workload

CEILING_TIMEOUT = 600.0
"""Seconds the parent waits for the ceiling's processes before giving up on them."""


@dataclass(frozen=True)
class Timing:
    """How long and how often to measure.

    Attributes:
        seconds: length of each timed window.
        warmup: seconds of stepping before the first window (not timed).
        repeats: timed windows; the median is reported.
        seed: seeds env resets and action sampling.
        action_batches: pre-sampled action batches, cycled through.
    """

    seconds: float = 3.0
    warmup: float = 0.5
    repeats: int = 3
    seed: int = 0
    action_batches: int = 256


@dataclass
class RunResult:
    """What one runner measured on one workload.

    Attributes:
        runner: runner name.
        throughputs: env-steps/s of each timed window.
        setup_s: seconds to build and reset the envs (before warm-up).
        info: runner-specific details (worker counts, ...).
    """

    runner: str
    throughputs: list[float]
    setup_s: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.throughputs)


def usable_cores() -> int:
    """Cores this process may run on (CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# -- timing loops --------------------------------------------------------------------------------


def _time_loop(step: Callable[[Any], object], actions: Sequence[Any], seconds: float) -> float:
    """Call ``step`` with actions cycled from ``actions`` for ``seconds``; calls per second."""
    n = len(actions)
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        step(actions[calls % n])
        calls += 1
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


def _measure(
    step: Callable[[Any], object], actions: Sequence[Any], envs_per_call: int, timing: Timing
) -> list[float]:
    _time_loop(step, actions, timing.warmup)
    return [
        envs_per_call * _time_loop(step, actions, timing.seconds) for _ in range(timing.repeats)
    ]


# -- plain for-loop ------------------------------------------------------------------------------


def _to_python(space: spaces.Space[Any], action: Any) -> Any:
    return int(action) if isinstance(space, spaces.Discrete) else action


def _for_loop_setup(
    workload: Workload, count: int, timing: Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[list[Any]], list[gymnasium.Env[Any, Any]]]:
    """Build and reset ``count`` envs; return a sweep function, its actions and the envs."""
    envs = [workload.build() for _ in range(count)]
    for i, env in enumerate(envs):
        env.reset(seed=timing.seed + first_index + i)
    space = envs[0].action_space
    space.seed(timing.seed + first_index)
    actions = [
        [_to_python(space, space.sample()) for _ in range(count)]
        for _ in range(timing.action_batches)
    ]

    def sweep(batch: list[Any]) -> None:
        for env, action in zip(envs, batch, strict=True):
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()

    return sweep, actions, envs


def run_for_loop(workload: Workload, timing: Timing) -> RunResult:
    """A Python for-loop over ``gymnasium.make`` envs in this process, resetting finished ones."""
    start = time.perf_counter()
    sweep, actions, envs = _for_loop_setup(workload, workload.num_envs, timing)
    setup_s = time.perf_counter() - start
    try:
        throughputs = _measure(sweep, actions, workload.num_envs, timing)
    finally:
        for env in envs:
            env.close()
    return RunResult("for-loop", throughputs, setup_s)


# -- independent-processes ceiling ---------------------------------------------------------------


def _ceiling_worker(
    workload: Workload,
    count: int,
    first_index: int,
    timing: Timing,
    started: Any,
    synced: Any,
    results: Any,
    index: int,
) -> None:
    try:
        sweep, actions, envs = _for_loop_setup(workload, count, timing, first_index)
        started.wait(CEILING_TIMEOUT)
        _time_loop(sweep, actions, timing.warmup)
        throughputs = []
        for _ in range(timing.repeats):
            synced.wait(CEILING_TIMEOUT)
            throughputs.append(count * _time_loop(sweep, actions, timing.seconds))
        for env in envs:
            env.close()
        results.put((index, throughputs, None))
    except BaseException as exc:
        started.abort()
        synced.abort()
        results.put((index, None, f"{type(exc).__name__}: {exc}"))


def run_ceiling(workload: Workload, timing: Timing) -> RunResult:
    """The envs split over one process per usable core, never communicating; throughputs summed.

    Each process runs the for-loop on its share; they start each timed window together (a
    barrier) and time it themselves.
    """
    num_procs = min(usable_cores(), workload.num_envs)
    counts = [len(ids) for ids in np.array_split(np.arange(workload.num_envs), num_procs)]
    firsts = np.cumsum([0, *counts[:-1]]).tolist()
    ctx = multiprocessing.get_context()
    started = ctx.Barrier(num_procs + 1)
    synced = ctx.Barrier(num_procs)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_ceiling_worker,
            args=(workload, counts[i], firsts[i], timing, started, synced, results, i),
            daemon=True,
        )
        for i in range(num_procs)
    ]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    try:
        try:
            started.wait(CEILING_TIMEOUT)
        except Exception:
            pass  # a worker failed; its message is on the queue
        setup_s = time.perf_counter() - start
        per_proc: list[list[float]] = []
        errors = []
        for _ in procs:
            _, throughputs, error = results.get(timeout=CEILING_TIMEOUT)
            if error is not None:
                errors.append(error)
            else:
                per_proc.append(throughputs)
        if errors:
            raise RuntimeError(f"ceiling process failed: {errors[0]}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    summed = [float(sum(window)) for window in zip(*per_proc, strict=True)]
    info = {"processes": num_procs, "envs_per_process": counts}
    return RunResult("ceiling", summed, setup_s, info)


# -- vector envs ---------------------------------------------------------------------------------


def _run_vector(
    name: str, build: Callable[[], VectorEnv], timing: Timing, **info: Any
) -> RunResult:
    start = time.perf_counter()
    vec = build()
    try:
        vec.reset(seed=timing.seed)
        setup_s = time.perf_counter() - start
        vec.action_space.seed(timing.seed)
        actions = [vec.action_space.sample() for _ in range(timing.action_batches)]
        throughputs = _measure(vec.step, actions, vec.num_envs, timing)
    finally:
        vec.close()
    return RunResult(name, throughputs, setup_s, info)


def run_sync_vector(workload: Workload, timing: Timing) -> RunResult:
    """Gymnasium's ``SyncVectorEnv``."""
    fns = [workload.factory()] * workload.num_envs
    return _run_vector("gym SyncVectorEnv", lambda: SyncVectorEnv(fns), timing)


def run_async_vector(workload: Workload, timing: Timing) -> RunResult:
    """Gymnasium's ``AsyncVectorEnv(shared_memory=True)``: one process per env."""
    fns = [workload.factory()] * workload.num_envs
    return _run_vector(
        "gym AsyncVectorEnv",
        lambda: AsyncVectorEnv(fns, shared_memory=True),
        timing,
        processes=workload.num_envs,
    )


def run_envfleet_serial(workload: Workload, timing: Timing) -> RunResult:
    """``envfleet.make(..., backend="serial")``."""
    return _run_vector(
        "envfleet serial",
        lambda: envfleet.make(workload.env, workload.num_envs, backend="serial"),
        timing,
    )


def run_envfleet_process(workload: Workload, timing: Timing) -> RunResult:
    """``envfleet.make(..., backend="process")`` with its default worker count."""
    return _run_vector(
        "envfleet process",
        lambda: envfleet.make(workload.env, workload.num_envs, backend="process"),
        timing,
        workers=min(usable_cores(), workload.num_envs),
    )


Runner = Callable[[Workload, Timing], RunResult]

RUNNERS: dict[str, Runner] = {
    "for-loop": run_for_loop,
    "ceiling": run_ceiling,
    "gym-sync": run_sync_vector,
    "gym-async": run_async_vector,
    "envfleet-serial": run_envfleet_serial,
    "envfleet-process": run_envfleet_process,
}
"""Every runner by its command-line name, in the order they are run and shown."""
