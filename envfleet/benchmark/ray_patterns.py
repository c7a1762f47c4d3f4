"""Plain Ray patterns, the baselines of envfleet's ray backend (Ray must be initialised).

- :func:`open_naive_ray` (``naive-ray``): one Ray actor per env, one remote call per env step
  (all in flight at once);
- :func:`open_batched_ray` (``batched-ray``): the envs split by hand over one actor per usable
  core, one remote call per actor steps all of its envs: what envfleet's ray backend automates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np

from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import LoopRunner, Runner, Timing, Workload
from envfleet.spec import EnvSpec


def _step_env(env: gymnasium.Env[Any, Any], action: Any) -> tuple[Any, float, bool, bool]:
    """One step, resetting an env whose episode ended (as the vector envs do)."""
    obs, reward, terminated, truncated, _ = env.step(action)
    if terminated or truncated:
        obs, _ = env.reset()
    return obs, float(reward), bool(terminated), bool(truncated)


class EnvActor:
    """The naive pattern: one env per actor, one remote call per step."""

    def __init__(self, spec: EnvSpec, seed: int) -> None:
        self.env = spec.build()
        self.env.reset(seed=seed)

    def ready(self) -> bool:
        return True

    def step(self, action: Any) -> tuple[Any, float, bool, bool]:
        return _step_env(self.env, action)


class BatchActor:
    """The hand-batched pattern: several envs per actor, stepped in one call."""

    def __init__(self, spec: EnvSpec, seeds: Sequence[int]) -> None:
        self.envs = [spec.build() for _ in seeds]
        for env, seed in zip(self.envs, seeds, strict=True):
            env.reset(seed=seed)

    def ready(self) -> bool:
        return True

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        results = [_step_env(env, a) for env, a in zip(self.envs, actions.tolist(), strict=True)]
        obs, rewards, terminated, truncated = zip(*results, strict=True)
        return np.stack(obs), np.array(rewards), np.array(terminated), np.array(truncated)


def _action_batches(workload: Workload, timing: Timing) -> list[np.ndarray]:
    env = workload.spec.build()
    try:
        space = gymnasium.vector.utils.batch_space(env.action_space, workload.num_envs)
    finally:
        env.close()
    space.seed(timing.seed)
    return [space.sample() for _ in range(timing.action_batches)]


def _kill_all(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)


def open_naive_ray(workload: Workload, timing: Timing) -> Runner:
    """One actor per env; each step sends every env its action, then waits for them all."""
    import ray

    start = time.perf_counter()
    cls: Any = ray.remote(num_cpus=0)(EnvActor)
    actors = [cls.remote(workload.spec, timing.seed + i) for i in range(workload.num_envs)]
    try:
        ray.get([actor.ready.remote() for actor in actors])
        setup_s = time.perf_counter() - start
        actions = [batch.tolist() for batch in _action_batches(workload, timing)]
    except BaseException:
        _kill_all(actors)
        raise

    def step(batch: list[Any]) -> None:
        ray.get([actor.step.remote(a) for actor, a in zip(actors, batch, strict=True)])

    return LoopRunner(
        "naive-ray",
        step,
        actions,
        workload.num_envs,
        timing,
        setup_s,
        lambda: _kill_all(actors),
        actors=len(actors),
    )


def open_batched_ray(workload: Workload, timing: Timing) -> Runner:
    """The envs split over one actor per usable core, each call stepping all of an actor's."""
    import ray

    start = time.perf_counter()
    blocks = np.array_split(
        np.arange(workload.num_envs), min(len(usable_cpus()), workload.num_envs)
    )
    cls: Any = ray.remote(num_cpus=0)(BatchActor)
    actors = [cls.remote(workload.spec, (timing.seed + block).tolist()) for block in blocks]
    try:
        ray.get([actor.ready.remote() for actor in actors])
        setup_s = time.perf_counter() - start
        actions = _action_batches(workload, timing)
    except BaseException:
        _kill_all(actors)
        raise

    def step(batch: np.ndarray) -> None:
        ray.get([actor.step.remote(batch[b]) for actor, b in zip(actors, blocks, strict=True)])

    return LoopRunner(
        "batched-ray",
        step,
        actions,
        workload.num_envs,
        timing,
        setup_s,
        lambda: _kill_all(actors),
        actors=len(actors),
    )
