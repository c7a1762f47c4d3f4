"""The rollout loop of ``bench/rollout.py``: its time accounting against a fake
clock, and per-env trajectories that do not depend on how the envs are batched."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import gymnasium
import numpy as np
import pytest

from bench.rollout import (
    Accounting,
    Rollout,
    RolloutWorkload,
    VectorStepper,
    open_envfleet_async,
    open_envfleet_sync,
)
from envfleet.benchmark import Workload

# Costs in seconds of fake time, exact in binary floating point.
POLICY_S, SEND_S, RECV_S = 0.25, 0.125, 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


class FakeStepper:
    """``num_envs`` envs handed back ``batch`` at a time, in turn; send and recv cost fake time."""

    def __init__(self, clock: FakeClock, num_envs: int, batch: int) -> None:
        self.clock, self.num_envs, self.batch = clock, num_envs, batch
        self.turn = 0
        self.sent: list[np.ndarray] = []
        self.handed: list[np.ndarray] = []

    def _ids(self) -> np.ndarray:
        first = (self.turn * self.batch) % self.num_envs
        self.turn += 1
        self.handed.append(np.arange(first, first + self.batch))
        return self.handed[-1]

    def start(self, seed: int) -> tuple[Any, np.ndarray]:
        ids = self._ids()
        return ids.astype(np.float32), ids

    def send(self, actions: Any, env_ids: np.ndarray) -> None:
        np.testing.assert_array_equal(actions, env_ids * 2)  # the policy saw these envs' obs
        self.sent.append(env_ids)
        self.clock.now += SEND_S

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        self.clock.now += RECV_S
        ids = self._ids()
        zeros = np.zeros(len(ids))
        return ids.astype(np.float32), zeros, zeros.astype(bool), zeros.astype(bool), ids

    def close(self) -> None:
        pass


def _policy(clock: FakeClock) -> Any:
    def policy(obs: np.ndarray) -> np.ndarray:
        clock.now += POLICY_S
        return obs.astype(np.int64) * 2

    return policy


@pytest.mark.parametrize("batch", [8, 4, 2])
def test_accounting_splits_wall_time_between_policy_and_envs(batch: int) -> None:
    clock = FakeClock()
    stepper = FakeStepper(clock, num_envs=8, batch=batch)
    rollout = Rollout(stepper, _policy(clock), clock=clock)
    clock.now += 3.0  # time before the stretch (setup) counts neither way
    acc = rollout.run(batches=6)
    per_batch = POLICY_S + SEND_S + RECV_S
    assert acc == Accounting(
        num_envs=8,
        wall_s=6 * per_batch,
        policy_s=6 * POLICY_S,
        env_wait_s=6 * (SEND_S + RECV_S),
        idle_env_s=6 * batch * POLICY_S,
        env_steps=6 * batch,
    )
    assert acc.policy_waited == (SEND_S + RECV_S) / per_batch
    # Sync: every env idles while the policy runs; half batches: only the half being decided.
    assert acc.envs_waited == pytest.approx(batch / 8 * POLICY_S / per_batch)
    assert acc.steps_per_s == pytest.approx(batch / per_batch)
    # The loop goes on where it stopped: each send is for the envs handed out just before,
    # across stretches too.
    again = rollout.run(seconds=2 * per_batch)
    assert again.env_steps == 2 * batch and again.wall_s == 2 * per_batch
    assert len(stepper.sent) == 8 and len(stepper.handed) == 9
    for sent, handed in zip(stepper.sent, stepper.handed, strict=False):
        np.testing.assert_array_equal(sent, handed)


def test_run_takes_exactly_one_bound() -> None:
    clock = FakeClock()
    rollout = Rollout(FakeStepper(clock, 4, 4), _policy(clock), clock=clock)
    with pytest.raises(ValueError, match="exactly one"):
        rollout.run()
    with pytest.raises(ValueError, match="exactly one"):
        rollout.run(seconds=1.0, batches=1)


def _deterministic_policy(obs: np.ndarray) -> np.ndarray:
    """Push the cart the way it moves (episodes end fast): a function of each row alone, so
    batching cannot matter."""
    return (obs[:, 1] > 0).astype(np.int64)


def _trajectories(stepper: Any, steps: int) -> dict[int, list[tuple[bytes, float, bool, bool]]]:
    """What each env returned, step by step, until every env has made ``steps`` steps.

    Async batches are the first envs ready: a worker that is slow to start (a loaded machine)
    can leave its envs out of the first batches, so the loop runs until every env got there.
    """
    seen: dict[int, list[tuple[bytes, float, bool, bool]]] = defaultdict(list)

    def record(ids: Any, obs: Any, rewards: Any, terminations: Any, truncations: Any) -> None:
        for row, env in enumerate(ids.tolist()):
            seen[env].append(
                (obs[row].tobytes(), float(rewards[row]), bool(terminations[row]),
                 bool(truncations[row]))
            )  # fmt: skip

    try:
        rollout = Rollout(stepper, _deterministic_policy, seed=7, record=record)
        for _ in range(1000):
            rollout.run(batches=1)
            if len(seen) == stepper.num_envs and min(map(len, seen.values())) >= steps:
                break
    finally:
        stepper.close()
    return seen


def test_sync_and_double_buffered_async_give_the_same_per_env_trajectories() -> None:
    num_envs = 8
    case = RolloutWorkload(
        "cartpole", Workload.of("CartPole-v1", num_envs), _deterministic_policy, num_workers=2
    )
    reference = _trajectories(
        VectorStepper(
            gymnasium.vector.SyncVectorEnv([case.workload.factory()] * num_envs), num_envs
        ),
        60,
    )
    sync = _trajectories(open_envfleet_sync(case, 0), 60)
    double_buffered = _trajectories(open_envfleet_async(case, 0), 60)
    assert sync == reference  # every env, every step: Gymnasium's SyncVectorEnv
    assert sorted(double_buffered) == list(range(num_envs))
    for env in range(num_envs):
        assert double_buffered[env][:60] == reference[env], f"env {env} differs"
    ended = sum(t or u for steps in reference.values() for _, _, t, u in steps)
    assert ended >= num_envs  # episodes ended and envs reset inside the compared stretch
