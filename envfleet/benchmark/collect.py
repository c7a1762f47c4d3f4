"""Collection where the envs are, as a runner: the workers act with a policy of their own.

A stepping runner pays a round trip to the driver for every vector step; a rollout runs
``steps`` steps in a row on the workers (:meth:`envfleet.Pool.rollout_async`) and ships what it
recorded. :class:`RolloutRunner` keeps every worker collecting: each has a part out and one
queued behind it (``queue=True``; else the next is sent once the last is handed over), and as
each part is handed over (``rollout_wait(min_envs=...)``) those envs' next part goes at once;
it counts the env-steps handed over. Each window runs from every worker idle to every worker
idle: no part begun before the clock started is counted, and every part begun in the window
is (a worker that finishes its last part before the others idles on the clock: a conservative
rate). The actions are pre-sampled like the stepping runners' (:class:`CycledActions`): the
same work, with the driver's round trips taken away. Rollouts of 128 steps (CleanRL's PPO's).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
from gymnasium import spaces

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.benchmark import base, peers


class CycledActions:
    """A policy of pre-sampled action batches, cycled as the stepping runners cycle theirs:
    env ``i``'s action is row ``i`` of the batch in turn (:func:`~envfleet.benchmark.sample_actions`
    with ``timing``'s seed and count). The batches are drawn on the worker, at its first call:
    only the space and the counts travel."""

    def __init__(self, space: spaces.Space[Any], num_envs: int, timing: base.Timing) -> None:
        self.space, self.num_envs = space, num_envs
        self.timing = timing
        self._table: np.ndarray | None = None
        self._turn = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None, "_turn": 0}

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        if self._table is None:
            self._table = np.stack(base.sample_actions(self.space, self.num_envs, self.timing))
        batch = self._table[self._turn % len(self._table)]
        self._turn += 1
        chosen: np.ndarray = batch[env_ids]
        return chosen


class RolloutRunner(base.Runner):
    """A pool collecting rollouts of ``steps`` steps, every worker kept busy (module docstring)."""

    def __init__(
        self,
        name: str,
        pool: envfleet.Pool,
        steps: int,
        timing: base.Timing,
        queue: bool = True,
        **info: Any,
    ) -> None:
        self.name, self.pool, self.steps, self.queue = name, pool, steps, queue
        self.info = {"steps": steps, "workers": pool.num_workers, "queue": queue, **info}
        self._rewarm = timing.rewarm
        try:
            self.policy = CycledActions(pool.single_action_space, pool.num_envs, timing)
            self.min_envs = min(len(w.env_ids) for w in pool.stats().workers)
            pool.reset(seed=timing.seed)
            start = time.perf_counter()
            self._collect(timing.warmup)
            self.warmup_s = time.perf_counter() - start
        except BaseException:
            pool.close()
            raise

    def _collect(self, seconds: float) -> float:
        """Env-steps per second, from every worker idle to every worker idle: rollouts started
        for ``seconds`` (each worker's envs again as soon as its part is in), then the parts
        still out waited for; every env-step counted, over the whole time."""
        pool, handed = self.pool, 0
        start = time.perf_counter()
        pool.rollout_async(self.policy, self.steps)
        if self.queue:
            pool.rollout_async(self.policy, self.steps, queue=True)
        while time.perf_counter() - start < seconds:
            rollout = pool.rollout_wait(min_envs=self.min_envs)
            handed += rollout.rewards.size
            pool.rollout_async(self.policy, self.steps, rollout.env_ids, queue=self.queue)
            del rollout
        with contextlib.suppress(envfleet.NoPendingError):
            while True:  # the parts still out
                handed += pool.rollout_wait().rewards.size
        return handed / (time.perf_counter() - start)

    def window(self, seconds: float) -> float:
        self._collect(self._rewarm)
        return self._collect(seconds)

    def close(self) -> None:
        self.pool.close()


def open_rollouts(
    workload: base.Workload,
    timing: base.Timing,
    *,
    name: str = "hosted-rollout",
    steps: int = 128,
    queue: bool = True,
    **make_kwargs: Any,
) -> base.Runner:
    """``envfleet.make(workload, **make_kwargs)`` collecting rollouts of ``steps`` steps
    (``queue``: a part queued behind each worker's)."""
    pool = envfleet.make(workload.spec, workload.num_envs, **make_kwargs)
    return RolloutRunner(name, pool, steps, timing, queue, **make_kwargs)


def open_ale_hosted_rollouts(workload: base.Workload, timing: base.Timing) -> base.Runner:
    """``ale-hosted``'s layout (:func:`~envfleet.benchmark.open_ale_hosted`: a worker per usable
    core hosting ale-vector's ``AtariVectorEnv`` on one thread) collecting rollouts."""
    fns = peers.ale_hosted_fns(workload.spec, workload.num_envs, len(usable_cpus()))
    pool = envfleet.make(vector_env_fns=fns, backend="process")
    return RolloutRunner(
        "ale-hosted-rollout", pool, 128, timing, threads=len(fns), ale_py=peers.version("ale-py")
    )


__all__ = ["CycledActions"]
