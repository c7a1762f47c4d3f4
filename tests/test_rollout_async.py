"""Asynchronous, versioned rollouts: ``rollout_async`` / ``rollout_wait``.

Oracles: the parts of asynchronous rollouts are bit for bit the synchronous ``rollout`` of the
same weights; every version stamped where it acted; a part done early is handed over once,
the others with a later wait; nothing lost or counted twice.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet

N, WORKERS = 6, 3


class Linear:
    """A deterministic policy with weights apart from its code: action = argmax(obs @ w),
    per env; ``loads`` counts the weights loaded (in the worker's copy)."""

    def __init__(self, w: np.ndarray) -> None:
        self.w = np.asarray(w, dtype=np.float64)
        self.loads = 0

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w.copy()}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        if weights["w"].shape != self.w.shape:
            raise ValueError(f"weights of shape {weights['w'].shape}, {self.w.shape} expected")
        self.w = np.asarray(weights["w"])
        self.loads += 1

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.asarray(np.argmax(np.asarray(observations) @ self.w, axis=1), dtype=np.int64)


def weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(4, 2))


def pool_of(backend: str, **kwargs: Any) -> envfleet.Pool:
    return envfleet.make("CartPole-v1", N, backend=backend, num_workers=WORKERS, seed=0, **kwargs)


def sync_reference(backend: str, versions: list[int], steps: int) -> list[envfleet.Rollout]:
    with pool_of(backend) as pool:
        pool.reset()
        return [pool.rollout(Linear(weights(v)), steps) for v in versions]


def assert_same(want: envfleet.Rollout, got: envfleet.Rollout, columns: Any = slice(None)) -> None:
    for name in ("observations", "actions", "rewards", "terminations", "truncations"):
        np.testing.assert_array_equal(
            getattr(want, name)[:, columns], getattr(got, name), err_msg=name
        )
    np.testing.assert_array_equal(want.final_observations[columns], got.final_observations)


def test_async_rollouts_are_the_synchronous_ones_with_each_version_stamped(backend: str) -> None:
    want = sync_reference(backend, [1, 2, 3], 20)
    policy = Linear(weights(1))
    with pool_of(backend) as pool:
        pool.reset()
        for k, v in enumerate([1, 2, 3]):
            policy.w = weights(v)
            version = pool.rollout_async(policy, 20)
            assert version == k + 1  # counted: the weights differ each time
            got = pool.rollout_wait()
            assert got.env_ids.tolist() == list(range(N))
            assert (got.policy_versions == version).all() and got.policy_versions.shape == (20, N)
            assert_same(want[k], got)
        same = pool.rollout_async(policy, 5)  # the same weights: the same version
        assert same == 3
        pool.rollout_wait()
        assert pool.rollout_async(policy, 5, version=10) == 10
        assert (pool.rollout_wait().policy_versions == 10).all()


def test_each_workers_part_comes_once_and_is_restarted_at_once() -> None:
    """Parts handed over as they are done, those envs started again at once with the next
    version: every env-step started is handed over once, stamped with its start's version."""
    policy = Linear(weights(1))
    with pool_of("process") as pool:
        pool.reset()
        started = np.full(N, pool.rollout_async(policy, 4))
        sent = 4 * N
        got = 0
        for _ in range(12):
            r = pool.rollout_wait(min_envs=2)
            assert len(r.env_ids) >= 2 and len(set(r.env_ids.tolist())) == len(r.env_ids)
            np.testing.assert_array_equal(r.policy_versions, np.tile(started[r.env_ids], (4, 1)))
            got += r.steps * len(r.env_ids)
            policy.w = policy.w + 1.0  # the learner's update: the next version
            started[r.env_ids] = pool.rollout_async(policy, 4, env_ids=r.env_ids)
            sent += 4 * len(r.env_ids)
        r = pool.rollout_wait()  # what is still out
        got += r.steps * len(r.env_ids)
        assert got == sent
        with pytest.raises(envfleet.NoPendingError):
            pool.rollout_wait()


def test_a_pending_rollout_refuses_steps_and_the_same_envs_twice() -> None:
    with pool_of("thread") as pool:
        pool.reset()
        pool.rollout_async(Linear(weights(1)), 3, env_ids=[0, 1])
        with pytest.raises(envfleet.AlreadyPendingError):
            pool.step(np.zeros(N, dtype=np.int64))
        with pytest.raises(envfleet.AlreadyPendingError):
            pool.rollout_async(Linear(weights(1)), 3, env_ids=[0, 1])
        with pytest.raises(ValueError, match="whole workers"):
            pool.rollout_async(Linear(weights(1)), 3, env_ids=[2])
        with pytest.raises(envfleet.AlreadyPendingError):
            pool.rollout(Linear(weights(1)), 3)
        r = pool.rollout_wait()
        assert r.env_ids.tolist() == [0, 1]
        pool.step(np.zeros(N, dtype=np.int64))  # usable again


def test_weights_that_fail_to_load_are_the_policys_error_and_the_pool_goes_on() -> None:
    policy = Linear(weights(1))
    with pool_of("process") as pool:
        pool.reset()
        pool.rollout_async(policy, 3)
        pool.rollout_wait()
        policy.w = np.zeros((5, 2))  # a shape the workers' copies refuse
        pool.rollout_async(policy, 3)
        with pytest.raises(envfleet.EnvError, match="could not load the weights of version 2"):
            pool.rollout_wait()
        policy.w = weights(2)
        pool.rollout_async(policy, 3)
        assert pool.rollout_wait().steps == 3


def test_parts_past_the_maximum_lag_are_dropped_and_counted() -> None:
    policy = Linear(weights(1))
    with pool_of("thread") as pool:
        pool.reset()
        assert pool.rollout_async(policy, 3, env_ids=[0, 1]) == 1
        policy.w = weights(2)
        assert pool.rollout_async(policy, 3, env_ids=[2, 3, 4, 5]) == 2
        r = pool.rollout_wait(max_lag=0)  # the envs 0-1 acted one version behind: dropped
        assert r.env_ids.tolist() == [2, 3, 4, 5] and (r.policy_versions == 2).all()
        assert r.dropped_env_ids.tolist() == [0, 1]  # named: the caller starts them anew
        stats = pool.stats()
        assert stats.rollout_lags == {0: 2, 1: 1}
        assert (stats.rollout_parts_dropped, stats.rollout_steps_dropped) == (1, 6)
        pool.rollout_async(policy, 3, env_ids=[*r.dropped_env_ids, *r.env_ids])
        again = pool.rollout_wait(max_lag=0)
        assert again.env_ids.tolist() == list(range(N)) and again.dropped_env_ids.size == 0
        pool.step(np.zeros(N, dtype=np.int64))  # every env idle again, the dropped ones too


def test_rollout_wait_timeout_hands_over_what_is_done_and_the_rest_later() -> None:
    class Slow(gymnasium.Wrapper[Any, Any, Any, Any]):
        def step(self, action: Any) -> Any:
            time.sleep(0.1)
            return self.env.step(action)

    fast, slow = lambda: gymnasium.make("CartPole-v1"), lambda: Slow(gymnasium.make("CartPole-v1"))
    with envfleet.make(
        [fast] * 2 + [slow] * 2,
        backend="thread",
        num_workers=2,
        seed=0,
    ) as pool:
        pool.reset()
        pool.rollout_async(Linear(weights(1)), 5)
        r = pool.rollout_wait(min_envs=1)
        assert r.env_ids.tolist() == [0, 1]  # the fast worker's, before the slow one's
        with pytest.raises(TimeoutError):
            pool.rollout_wait(timeout=0.05)
        r = pool.rollout_wait()
        assert r.env_ids.tolist() == [2, 3]


def test_close_with_a_rollout_pending_is_bounded() -> None:
    pool = pool_of("process")
    pool.reset()
    pool.rollout_async(Linear(weights(1)), 200)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 30
