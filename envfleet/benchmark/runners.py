"""Runners in this process's own stack: the for-loop, the independent-processes ceiling,
envfleet's backends and Gymnasium's vector envs."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import queue
import time
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.benchmark import base
from envfleet.rollout_loop import record_arrays, tree
from envfleet.threads import split_ids

CEILING_TIMEOUT = 600.0
"""Seconds the ceiling's processes and their parent wait for each other before giving up."""


def _to_python(space: spaces.Space[Any], action: Any) -> Any:
    return int(action) if isinstance(space, spaces.Discrete) else action


def _close(envs: list[gymnasium.Env[Any, Any]]) -> None:
    for env in envs:
        env.close()


def blocks(num_envs: int, parts: int) -> tuple[list[int], list[int]]:
    """``num_envs`` envs split into ``parts`` consecutive blocks (fewer when there are fewer
    envs) as the pool splits them (:func:`~envfleet.threads.split_ids`): each block's size and
    its first env's index."""
    split = split_ids(range(num_envs), parts)
    return [len(ids) for ids in split], [ids[0] for ids in split]


def _for_loop(
    workload: base.Workload, count: int, timing: base.Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[list[Any]], list[gymnasium.Env[Any, Any]]]:
    """Build and reset ``count`` envs; return a sweep over them, its actions and the envs."""
    envs: list[gymnasium.Env[Any, Any]] = []
    try:
        for i in range(count):
            envs.append(workload.build())
            envs[-1].reset(seed=timing.seed + first_index + i)
        space = envs[0].action_space
        space.seed(timing.seed + first_index)
        actions = [
            [_to_python(space, space.sample()) for _ in range(count)]
            for _ in range(timing.action_batches)
        ]
    except BaseException:
        _close(envs)
        raise

    def sweep(batch: list[Any]) -> None:
        for env, action in zip(envs, batch, strict=True):
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()

    return sweep, actions, envs


def _vector_loop(
    workload: base.Workload, count: int, timing: base.Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[Any], Any]:
    """Build and reset the id's own VectorEnv of ``count`` envs (its vector entry point);
    return its step, its actions and the env."""
    venv = _make_vec(workload.spec, count)
    try:
        venv.reset(seed=timing.seed + first_index)
        space = venv.action_space
        space.seed(timing.seed + first_index)
        actions = [space.sample() for _ in range(timing.action_batches)]
    except BaseException:
        venv.close()
        raise
    return venv.step, actions, venv


RECORDED_STEPS = 128
"""Steps a recording loop's columns hold (a rollout's, as the ``hosted-rollout`` runner's;
written over again each time round)."""


class Recording:
    """A VectorEnv acting and recording as a worker collecting a rollout must: each call picks
    its envs' actions from the batch it is given (the ``hosted-rollout`` runner's policy,
    :class:`~envfleet.benchmark.collect.CycledActions`), steps, and records the observations
    the actions were chosen on, the actions, rewards and flags in :attr:`columns` of
    :data:`RECORDED_STEPS` steps (row ``t`` of each, ``t`` going round): the least a layout
    that collects rollouts where the envs are does, with no pool at all."""

    def __init__(self, venv: Any, seed: int) -> None:
        self.venv = venv
        self.spaces = venv.single_observation_space, venv.single_action_space
        self.columns = record_arrays(*self.spaces, RECORDED_STEPS, venv.num_envs, np.float64)
        # Observations and actions that are one array each (Box, Discrete...) are written
        # straight into their row, as the rollout loop writes them; nested ones leaf by leaf.
        self.flat = all(isinstance(c, np.ndarray) for c in self.columns[:2])
        self.index = np.arange(venv.num_envs)
        self.obs, self.t = venv.reset(seed=seed)[0], 0

    def __call__(self, batch: Any) -> None:
        t = self.t % RECORDED_STEPS
        observations, actions, rewards, terminations, truncations = self.columns
        chosen = batch[self.index] if isinstance(batch, np.ndarray) else batch
        if self.flat:
            observations[t] = self.obs
            actions[t] = chosen
        else:

            def row_t(leaf: np.ndarray, value: Any) -> None:
                leaf[t] = value

            tree(self.spaces[0], row_t, observations, self.obs)
            tree(self.spaces[1], row_t, actions, chosen)
        self.obs, rewards[t], terminations[t], truncations[t], _ = self.venv.step(chosen)
        self.t += 1


def _recording_loop(
    workload: base.Workload, count: int, timing: base.Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[Any], Any]:
    """:func:`_vector_loop`'s VectorEnv as a :class:`Recording`, its actions and the env."""
    _, actions, venv = _vector_loop(workload, count, timing, first_index)
    return Recording(venv, timing.seed + first_index), actions, venv


def vector_check(spec: Any) -> str | None:
    """Why ``spec`` has no VectorEnv of its own to host (``None``: it has one)."""
    from envfleet.tune import has_vector_entry_point

    if has_vector_entry_point(spec):
        return None
    return f"{spec.name} has no vector entry point (gymnasium.make_vec's vector_entry_point)"


def open_vector_alone(workload: base.Workload, timing: base.Timing) -> base.Runner:
    """The id's own VectorEnv of every env, alone in this process."""
    return base.open_vector("vector", lambda: _make_vec(workload.spec, workload.num_envs), timing)


def _make_vec(spec: Any, count: int) -> Any:
    """The id's own VectorEnv of ``count`` envs (:func:`vector_check` said it has one)."""
    if not isinstance(spec.target, str):
        raise ValueError(vector_check(spec) or f"{spec.name}: no registered id")
    return gymnasium.make_vec(
        spec.target, count, vectorization_mode="vector_entry_point", **dict(spec.kwargs)
    )


def open_loop(workload: base.Workload, timing: base.Timing) -> base.Runner:
    """A Python for-loop over the envs in this process, resetting finished ones."""
    sweep, actions, envs = _for_loop(workload, workload.num_envs, timing)
    advance = base.cycle(sweep, actions, workload.num_envs)
    return base.CallRunner(base.LOOP, advance, functools.partial(_close, envs), timing)


def _ceiling_worker(
    workload: base.Workload,
    counts: list[int],
    firsts: list[int],
    timing: base.Timing,
    index: int,
    go: Any,
    seconds: Any,
    results: Any,
    vectorized: bool = False,
    recording: bool = False,
) -> None:
    """Build process ``index``'s share of the envs (``counts[index]`` of them; ``vectorized``:
    as the id's own VectorEnv, ``recording`` its steps as a rollout does); at each ``go``, time
    a window of ``seconds.value`` of sweeps over them (<= 0: stop)."""
    try:
        build = _recording_loop if recording else _vector_loop if vectorized else _for_loop
        sweep, actions, _ = build(workload, counts[index], timing, firsts[index])
        step = base.cycle(sweep, actions, counts[index])
        results.put((index, "ready", None))
        while True:
            go.wait(CEILING_TIMEOUT)
            window = seconds.value
            if window <= 0:
                break
            base.time_calls(step, timing.rewarm)
            results.put((index, base.time_calls(step, window), None))
    except BaseException as exc:
        results.put((index, None, f"{type(exc).__name__}: {exc}"))
        go.abort()


class CeilingRunner(base.Runner):
    """The envs split over one process per usable core, never communicating; throughputs summed.

    Each process runs the for-loop on its share (``vectorized``: the id's own VectorEnv;
    ``recording``: that VectorEnv acting and recording its steps, :func:`_recording_loop`); the
    parent only starts each window (a barrier) and adds up what the processes measured inside
    it.
    """

    def __init__(
        self,
        workload: base.Workload,
        timing: base.Timing,
        vectorized: bool = False,
        recording: bool = False,
    ) -> None:
        count = min(len(usable_cpus()), workload.num_envs)
        counts, firsts = blocks(workload.num_envs, count)
        self.name = base.CEILING
        if vectorized or recording:
            self.name = "vector-recording-ceiling" if recording else "vector-ceiling"
        self.info = {"processes": count, "envs_per_process": counts}
        ctx = multiprocessing.get_context()
        self._go, self._seconds, self._results = ctx.Barrier(count + 1), ctx.Value("d"), ctx.Queue()
        args = (workload, counts, firsts, timing)
        self._workers = [
            ctx.Process(
                target=_ceiling_worker,
                args=(*args, i, self._go, self._seconds, self._results, vectorized, recording),
                daemon=True,
            )
            for i in range(count)
        ]
        start = time.perf_counter()
        for worker in self._workers:
            worker.start()
        try:
            self._gather()
            self.setup_s = time.perf_counter() - start
            self.window(timing.warmup)
        except BaseException:
            self.close()
            raise

    def _gather(self) -> list[Any]:
        values, errors = [], []
        for _ in self._workers:
            _, value, error = self._results.get(timeout=CEILING_TIMEOUT)
            if error is None:
                values.append(value)
            else:
                errors.append(error)
        if errors:  # the cause, not the broken barrier it left the others waiting at
            with contextlib.suppress(queue.Empty):  # the cause may come in after the others
                while all(error.startswith("BrokenBarrierError") for error in errors):
                    errors.append(self._results.get(timeout=1.0)[2] or "BrokenBarrierError")
            errors.sort(key=lambda error: error.startswith("BrokenBarrierError"))
            raise RuntimeError(f"a {self.name} worker failed: {errors[0]}")
        return values

    def window(self, seconds: float) -> float:
        self._seconds.value = seconds
        self._go.wait(CEILING_TIMEOUT)
        return float(sum(self._gather()))

    def close(self) -> None:
        self._seconds.value = 0.0
        with contextlib.suppress(Exception):  # broken by a failed worker: terminated below
            self._go.wait(10.0)
        base.join_all(self._workers)
        self._results.close()
        self._results.join_thread()


def open_envfleet(
    workload: base.Workload,
    timing: base.Timing,
    *,
    name: str | None = None,
    batch_size: int | None = None,
    policy: Callable[[Any], Any] | None = None,
    **make_kwargs: Any,
) -> base.Runner:
    """``envfleet.make(workload, **make_kwargs)`` stepped whole, or by ``batch_size`` envs
    (``recv`` + ``send``), by ``policy`` if given; ``name``: default the backend's."""
    pool = envfleet.make(workload.spec, workload.num_envs, batch_size=batch_size, **make_kwargs)
    return base.open_vector(
        name or str(make_kwargs.get("backend", "process")),
        lambda: pool,
        timing,
        batch=batch_size,
        policy=policy,
        workers=pool.num_workers,
        batch_size=pool.batch_size,
        **make_kwargs,
    )


def envfleet_opener(
    backend: str, name: str | None = None, **make_kwargs: Any
) -> Callable[[base.Workload, base.Timing], base.Runner]:
    """An opener of :func:`open_envfleet` on ``backend`` (default workers unless
    ``make_kwargs`` say otherwise)."""
    return functools.partial(open_envfleet, name=name or backend, backend=backend, **make_kwargs)


def open_gym_sync(workload: base.Workload, timing: base.Timing) -> base.Runner:
    """Gymnasium's ``SyncVectorEnv``."""
    fns = [workload.factory()] * workload.num_envs
    return base.open_vector("gym-sync", lambda: SyncVectorEnv(fns), timing)


def open_gym_async(
    workload: base.Workload, timing: base.Timing, policy: Callable[[Any], Any] | None = None
) -> base.Runner:
    """Gymnasium's ``AsyncVectorEnv(shared_memory=True)``: one process per env."""
    fns = [workload.factory()] * workload.num_envs
    return base.open_vector(
        "gym-async",
        lambda: AsyncVectorEnv(fns, shared_memory=True),
        timing,
        policy=policy,
        processes=workload.num_envs,
    )


__all__ = [
    "RECORDED_STEPS",
    "CeilingRunner",
    "Recording",
    "blocks",
    "envfleet_opener",
    "open_envfleet",
    "open_gym_async",
    "open_loop",
]
