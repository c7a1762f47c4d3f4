"""Queued rollouts: ``rollout_async(..., queue=True)`` puts a worker's next part behind the one
it has out, which it starts as soon as that one ends (no round trip to the pool between).

Oracles: queued parts are bit for bit the synchronous rollouts one after another, each
version stamped where it acted; a hand-over holds each env's steps once, a worker's parts
coming in the order it ran them, whatever ``min_envs``; a third part, or a part behind a
step, is refused before anything is sent; a worker killed with a part out and one queued
has both delivered (the first restarted), each env-step counted once.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import envfleet
from tests.faults import SEED
from tests.test_rollout_async import (
    WORKERS,
    Linear,
    N,
    assert_same,
    pool_of,
    sync_reference,
    weights,
)
from tests.test_rollout_faults import (
    LOST,
    STEPS,
    Shift,
    assert_restarted_part,
    start_then_kill,
    victim_pool,
)


def test_queued_parts_are_the_synchronous_rollouts_one_after_another(backend: str) -> None:
    want = sync_reference(backend, [1, 2, 3], 20)
    with pool_of(backend) as pool:
        pool.reset()
        assert pool.rollout_async(Linear(weights(1)), 20) == 1
        assert pool.rollout_async(Linear(weights(2)), 20, queue=True) == 2
        got = [pool.rollout_wait()]
        assert pool.rollout_async(Linear(weights(3)), 20, queue=True) == 3
        got += [pool.rollout_wait(), pool.rollout_wait()]
        with pytest.raises(envfleet.NoPendingError):
            pool.rollout_wait()
        for k, rollout in enumerate(got):
            assert rollout.env_ids.tolist() == list(range(N))
            assert (rollout.policy_versions == k + 1).all()
            assert_same(want[k], rollout)
        # Each part's lag: the newest version sent when it was handed over, less its own.
        assert pool.stats().rollout_lags == {1: 2 * pool.num_workers, 0: pool.num_workers}


def test_each_hand_over_holds_an_envs_steps_once_in_the_order_they_ran() -> None:
    want = sync_reference("process", [1, 1], 10)
    policy = Linear(weights(1))
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(N)}
    with pool_of("process") as pool:
        pool.reset()
        pool.rollout_async(policy, 10)
        pool.rollout_async(policy, 10, queue=True)
        while True:
            try:
                got = pool.rollout_wait(min_envs=2)
            except envfleet.NoPendingError:
                break
            ids = got.env_ids.tolist()
            assert len(set(ids)) == len(ids) and ids == sorted(ids)
            for column, i in enumerate(ids):
                seen[i].append(got.observations[:, column])
    for i in range(N):
        assert len(seen[i]) == 2, f"env {i}: {len(seen[i])} parts"
        for k in range(2):
            np.testing.assert_array_equal(seen[i][k], want[k].observations[:, i], f"env {i}")


def test_a_third_part_or_a_part_behind_a_step_is_refused_before_anything_is_sent() -> None:
    policy = Linear(weights(1))
    with pool_of("process", batch_size=2) as pool:
        pool.reset()
        pool.send(np.zeros(2, dtype=np.int64), env_id=[2, 3])
        with pytest.raises(envfleet.AlreadyPendingError, match=r"envs \[2, 3\]"):
            pool.rollout_async(policy, 5, env_ids=[2, 3], queue=True)
        pool.recv()
        pool.rollout_async(policy, 5, env_ids=[0, 1])
        pool.rollout_async(policy, 5, env_ids=[0, 1], queue=True)
        with pytest.raises(envfleet.AlreadyPendingError, match=r"envs \[0, 1\].*2 parts at most"):
            pool.rollout_async(policy, 5, env_ids=[0, 1], queue=True)
        with pytest.raises(envfleet.AlreadyPendingError, match=r"envs \[0, 1\]"):
            pool.rollout_async(policy, 5, env_ids=[0, 1])  # not queued: behind nothing
        assert pool.rollout_wait().env_ids.tolist() == [0, 1]
        assert pool.rollout_wait().env_ids.tolist() == [0, 1]
        assert pool.rollout(policy, 3).steps == 3  # the pool goes on


def test_a_dropped_part_with_one_queued_behind_has_its_envs_start_behind_that_one() -> None:
    """``max_lag`` drops a part whose worker runs the part queued behind it: its envs are
    dropped (named in ``dropped_env_ids``) but not idle, so their next part goes behind the
    one running (``queue=True``), as a handed-over part's would; unqueued it is refused, naming
    them, and nothing is sent. Every part started comes back once, handed over or dropped."""
    policy = Linear(weights(1))
    per_worker = N // WORKERS
    with pool_of("process") as pool:
        pool.reset()
        pool.rollout_async(policy, 4, version=0)
        pool.rollout_async(policy, 4, version=0, queue=True)  # two parts per worker out
        first = pool.rollout_wait(min_envs=2)  # one or more workers' first parts
        handed, dropped_parts = {0: len(first.env_ids) // per_worker, 10: 0}, 0
        pool.rollout_async(policy, 4, first.env_ids, version=10, queue=True)
        started = {0: 2 * WORKERS, 10: len(first.env_ids) // per_worker}
        got = pool.rollout_wait(max_lag=2)  # every version-0 part in is 10 behind: dropped
        dropped = got.dropped_env_ids
        assert got.env_ids.size == 0 and dropped.size
        dropped_parts += len(dropped) // per_worker
        with pytest.raises(envfleet.AlreadyPendingError, match=rf"envs \[{dropped[0]}, "):
            pool.rollout_async(policy, 4, dropped, version=10)
        pool.rollout_async(policy, 4, dropped, version=10, queue=True)
        started[10] += len(dropped) // per_worker
        while True:
            try:
                got = pool.rollout_wait(max_lag=2)
            except envfleet.NoPendingError:
                break
            for version in np.unique(got.policy_versions).tolist():
                handed[version] += (got.policy_versions[0] == version).sum() // per_worker
            dropped_parts += len(got.dropped_env_ids) // per_worker
        assert handed[10] == started[10]  # every newer part handed over
        assert handed[0] + dropped_parts == started[0]  # every older one handed or dropped
        assert pool.rollout(policy, 2).steps == 2  # the pool goes on


class Counted:
    """A policy that counts its calls in this process (its class is pickled by reference:
    the thread backend's workers share the count) and takes ``delay`` seconds each."""

    calls = 0

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, observations: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        type(self).calls += 1
        time.sleep(self.delay)
        return np.zeros(len(observations), dtype=np.int64)


def test_close_drops_the_parts_queued_behind_on_the_thread_backend() -> None:
    """A thread cannot be killed: close() lets each finish what it has begun, but a part queued
    behind it is dropped, not run (it stepped envs after the pool was closed)."""
    steps = 20
    pool = pool_of("thread")
    pool.reset()
    Counted.calls = 0
    policy = Counted(0.01)
    pool.rollout_async(policy, steps)
    pool.rollout_async(policy, steps, queue=True)
    while Counted.calls == 0:  # the first parts have begun
        time.sleep(0.001)
    pool.close(timeout=30)
    assert Counted.calls <= WORKERS * steps  # the first parts at most, nothing queued
    time.sleep(0.1)
    assert Counted.calls <= WORKERS * steps


def test_a_worker_killed_with_a_part_queued_delivers_both_each_step_once(tmp_path: Path) -> None:
    marker, lost = tmp_path / "marker", LOST
    with victim_pool(marker, on_error="restart") as pool:
        policy = Shift(1)
        start_then_kill(pool, policy, marker, None, queued=True)
        before = pool.stats()
        first = pool.rollout_wait()
        assert_restarted_part(first, lost, (SEED + np.arange(N)) * 100 + 2)
        second = pool.rollout_wait()
        after = pool.stats()
        assert (second.policy_versions == 2).all() and not second.truncations.any()
        counts = second.observations[:, :, 0]
        np.testing.assert_array_equal(counts[0], first.final_observations[:, 0])
        np.testing.assert_array_equal(counts - counts[0], np.tile(np.arange(STEPS), (N, 1)).T)
        np.testing.assert_array_equal(second.actions, (counts + 2) % 3)
        assert after.steps - before.steps == 2 * N * STEPS  # each env-step once: none twice
        assert after.rollout_lags == {0: 3 * WORKERS}
        np.testing.assert_array_equal(pool.restarts, lost.astype(np.int64))
