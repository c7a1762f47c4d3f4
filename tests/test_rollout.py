"""A policy in the loop (``bench/rollout.py`` over the engine's runners): the policy's actions
are the ones stepped, whole or by batch, per-env trajectories do not depend on how the envs are
batched, and the time accounting against a fake clock."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
from bench.rollout import PolicyRunner, RolloutWorkload
from envfleet.benchmark import Runner, Timing, Workload, open_vector

TIMING = Timing(seconds=0.05, warmup=0.0, rewarm=0.0, repeats=1, seed=7)
CARTPOLE = Workload.of("CartPole-v1", 4)


def _push(obs: np.ndarray) -> np.ndarray:
    """Push the cart the way it moves (episodes end fast): a function of each row alone, so
    batching cannot matter."""
    return (obs[:, 1] > 0).astype(np.int64)


Trajectories = dict[int, list[tuple[bytes, float, bool, bool]]]


class Recording:
    """A vector env whose every result is noted per env (``recv``: the envs it names)."""

    def __init__(self, vec: Any) -> None:
        self.vec = vec
        self.seen: Trajectories = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.vec, name)

    def _note(self, out: Any, ids: Any) -> Any:
        obs, rewards, terminations, truncations, *_ = out
        for row, env in enumerate(ids):
            self.seen[env].append(
                (obs[row].tobytes(), float(rewards[row]), bool(terminations[row]),
                 bool(truncations[row]))
            )  # fmt: skip
        return out

    def reset(self, **kwargs: Any) -> Any:  # as an async reset's results come: rewards 0
        obs, infos = self.vec.reset(**kwargs)
        no = np.zeros(self.vec.num_envs)
        self._note((obs, no, no, no), range(self.vec.num_envs))
        return obs, infos

    def step(self, actions: Any) -> Any:
        return self._note(self.vec.step(actions), range(self.vec.num_envs))

    def recv(self) -> Any:
        out = self.vec.recv()
        return self._note(out, out[4]["env_id"].tolist())


def _driven(runner: Runner, vec: Recording, steps: int) -> Trajectories:
    """Advance until every env has made ``steps`` steps, for 60 s at most (async batches are
    the first envs ready: a worker that a loaded machine serves late can leave its envs out of
    most batches, and once left 12 steps short after 1,000 of them)."""
    deadline = time.monotonic() + 60.0
    try:
        while time.monotonic() < deadline:
            runner.advance()  # type: ignore[attr-defined]
            if len(vec.seen) == 4 and min(map(len, vec.seen.values())) >= steps:
                break
    finally:
        runner.close()
    return vec.seen


def test_a_policy_drives_the_steps_whole_or_by_batch_with_the_same_trajectories() -> None:
    reference = Recording(gymnasium.vector.SyncVectorEnv([CARTPOLE.factory()] * 4))
    expected = _driven(open_vector("sync", lambda: reference, TIMING, policy=_push), reference, 61)
    oracle = gymnasium.vector.SyncVectorEnv([CARTPOLE.factory()] * 4)
    obs, _ = oracle.reset(seed=TIMING.seed)
    for step in range(60):  # what the policy decided is what was stepped, from the reset on
        obs = oracle.step(_push(obs))[0]
        for env in range(4):
            assert expected[env][step + 1][0] == obs[env].tobytes()
    for batch in (None, 2):
        pool = Recording(envfleet.make(CARTPOLE.spec, 4, num_workers=2, batch_size=batch))
        runner = open_vector("pool", lambda pool=pool: pool, TIMING, batch=batch, policy=_push)
        got = _driven(runner, pool, 61)
        assert sorted(got) == list(range(4))
        for env in range(4):
            assert got[env][:61] == expected[env][:61], f"env {env} differs (batch {batch})"
    ended = sum(t or u for steps in expected.values() for _, _, t, u in steps[:61])
    assert ended >= 4  # episodes ended and envs reset inside the compared stretch


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


class FakeRunner(Runner):
    """Each window takes 2 s of fake time, 0.5 s of it in the policy."""

    def __init__(self, clock: FakeClock, policy: Any, batch: int | None) -> None:
        self.clock, self.policy, self.setup_s = clock, policy, 0.0
        self.info = {"batch_size": batch} if batch else {}

    def window(self, seconds: float) -> float:
        self.clock.now += 1.5
        self.policy(None)
        return 100.0


@pytest.mark.parametrize(("batch", "envs_waited"), [(8, 0.25), (4, 0.125), (None, 0.25)])
def test_accounting_splits_wall_time_between_policy_and_envs(
    batch: int | None, envs_waited: float
) -> None:
    clock = FakeClock()

    def policy(obs: Any) -> None:
        clock.now += 0.5

    case = RolloutWorkload("fake", Workload.of("CartPole-v1", 8), policy)
    runner = PolicyRunner(
        "fake", case, case.workload, TIMING, clock=clock,
        opener=lambda name, case, decide, timing: FakeRunner(clock, decide, batch),
    )  # fmt: skip
    assert runner.window(1.0) == runner.window(1.0) == 100.0
    # The policy took a quarter of the wall time: the caller waited for the envs the rest.
    assert runner.info["policy_waited"] == [0.75, 0.75]
    # Sync: every env idles while the policy runs; half batches: only the half being decided.
    assert runner.info["envs_waited"] == [envs_waited, envs_waited]
