"""Rollout memory used again once dropped, never while held; weights hashed only when counted.

Oracles: an array, a view or a tensor over a recycled block keeps it from being handed out
again, and a block comes back once the last of them is gone; a rollout the caller holds keeps
its values through later rollouts, a dropped one's memory is the next one's, and every rollout
is the one a pool that reuses nothing gives; a frame's digest is its contents' when the pool
counts versions, and a token of its own under the caller's versions.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet import weight_frames
from envfleet.recycling import Recycler
from envfleet.shipping import Shipper
from tests.envs import FramesEnv

MIB = 1 << 20


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_a_block_comes_back_only_when_every_array_view_and_tensor_over_it_is_gone() -> None:
    torch = pytest.importorskip("torch")
    memory = Recycler(keep=2)
    first = memory.empty((4, MIB // 4), np.float32)
    where = address(first)
    view, tensor = first[1:3, ::2], torch.from_numpy(first[3])
    del first
    gc.collect()
    assert memory.free_bytes() == 0  # a view and a tensor still hold it
    taken = memory.empty((4, MIB // 4), np.float32)
    assert not np.shares_memory(taken, view)
    del view, taken
    gc.collect()
    assert memory.free_bytes() == MIB * 4  # the second block is free, the first still held
    tensor.fill_(7.0)
    del tensor
    gc.collect()
    assert memory.free_bytes() == 2 * MIB * 4
    again = memory.empty(MIB, np.float32)  # the same bytes, any shape: the last freed block
    assert address(again) == where and again.flags.writeable
    np.testing.assert_array_equal(again[3 * MIB // 4 :], 7.0)  # what the tensor wrote
    assert memory.free_bytes() == MIB * 4


def test_small_arrays_are_plain_and_free_blocks_are_bounded_and_cleared() -> None:
    memory = Recycler(keep=1)
    small = memory.empty((10, 10), np.int64)
    assert small.flags.owndata and small.shape == (10, 10)
    blocks = [memory.empty(2 * MIB, np.uint8) for _ in range(3)]
    del blocks
    gc.collect()
    assert memory.free_bytes() == 2 * MIB  # one kept of its size
    memory.clear()
    assert memory.free_bytes() == 0
    dropped = memory.empty(2 * MIB, np.uint8)
    del dropped
    gc.collect()
    assert memory.free_bytes() == 0  # closed: none kept


def test_a_free_block_goes_back_to_whom_it_was_given_first() -> None:
    """Blocks given with hints come back to the same hint while free ones of it are kept
    (``keep_at_least``), whatever order they were freed in; a hint with none takes any."""
    memory = Recycler(keep=1, shared=True)
    memory.keep_at_least(3)
    given = {hint: memory.empty(2 * MIB, np.uint8, hint=hint) for hint in ("a", "b", "c")}
    where = {hint: array.ctypes.data for hint, array in given.items()}
    for hint in ("b", "a", "c"):  # freed in another order than given
        del given[hint]
    gc.collect()
    assert memory.free_bytes() == 3 * 2 * MIB
    again = {hint: memory.empty(2 * MIB, np.uint8, hint=hint) for hint in ("a", "c", "b")}
    assert {hint: array.ctypes.data for hint, array in again.items()} == where
    assert memory.empty(2 * MIB, np.uint8, hint="d").ctypes.data not in where.values()
    memory.clear()


FIELDS = ("observations", "actions", "rewards", "terminations", "truncations")


def rollouts(pool: envfleet.Pool, count: int) -> list[envfleet.Rollout]:
    pool.reset(seed=0)
    policy = envfleet.RandomPolicy(pool.single_action_space, seed=1)
    return [pool.rollout(policy, 30) for _ in range(count)]


@pytest.mark.parametrize("kind", ["serial", "process"])
def test_a_held_rollout_keeps_its_values_and_a_dropped_ones_memory_is_the_next_ones(
    kind: str,
) -> None:
    make: dict[str, Any] = {"backend": kind, "num_workers": 2, "seed": 0}
    with envfleet.make(FramesEnv, 4, **make) as pool:  # 30 x 4 frames: 1.4 MB, recycled
        want = [{name: np.copy(getattr(r, name)) for name in FIELDS} for r in rollouts(pool, 3)]
    with envfleet.make(FramesEnv, 4, **make) as pool:
        pool.reset(seed=0)
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=1)
        held = pool.rollout(policy, 30)
        second = pool.rollout(policy, 30)
        assert not np.shares_memory(held.observations, second.observations)
        where = address(second.observations)
        got = [{name: np.copy(getattr(second, name)) for name in FIELDS}]
        memory = pool._life.memory
        free = memory.free_bytes()
        del second
        gc.collect()
        assert memory.free_bytes() > free  # its blocks came back
        third = pool.rollout(policy, 30)
        assert address(third.observations) == where  # the dropped rollout's memory
        assert memory.free_bytes() == free
        got.append({name: getattr(third, name) for name in FIELDS})
        for k, rollout in enumerate([{n: getattr(held, n) for n in FIELDS}, *got]):
            for name in FIELDS:
                np.testing.assert_array_equal(rollout[name], want[k][name], err_msg=name)


class Weights:
    def __init__(self) -> None:
        self.w = np.arange(4096, dtype=np.float64)

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.w = weights["w"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(env_ids), dtype=np.int64)


def test_weights_are_hashed_when_the_pool_counts_versions_and_not_under_the_callers() -> None:
    weights = {"w": np.arange(4096, dtype=np.float64), "b": np.ones(3)}
    hashed = [weight_frames.pack(weights) for _ in range(2)]
    tokens = [weight_frames.pack(weights, hashed=False) for _ in range(2)]
    assert weight_frames.digest(hashed[0]) == weight_frames.digest(hashed[1])
    assert len({weight_frames.digest(f) for f in [*tokens, hashed[0]]}) == 3
    for frame in [*hashed, *tokens]:
        got = weight_frames.load(frame)
        np.testing.assert_array_equal(got["w"], weights["w"])
        np.testing.assert_array_equal(got["b"], weights["b"])
    shipper, policy = Shipper(), Weights()
    assert [shipper.prepare(policy, None) for _ in range(2)] == [1, 1]  # the same contents
    assert shipper.prepare(policy, 5) == 5
    assert shipper.prepare(policy, None) == 6  # after the caller's version: one more
    assert shipper.prepare(policy, None) == 6
    policy.w = policy.w + 1
    assert shipper.prepare(policy, None) == 7


def test_no_memory_is_kept_once_the_pool_is_closed() -> None:
    """The serial backend records its rollouts in the pool's own process: the memory its groups
    and the pool keep for the next rollout goes with the pool."""
    from envfleet import rollout_loop

    records = rollout_loop._RECORDS
    before = set(map(id, records))
    with envfleet.make(FramesEnv, 4, backend="serial", num_workers=2, seed=0) as pool:
        pool.reset(seed=0)
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=1)
        for _ in range(2):
            pool.rollout(policy, 100)  # 2.4 MB of frames a worker's part, 4.8 MB in all
        gc.collect()
        kept = [g for g in records if id(g) not in before]
        assert kept and all(records[g].free_bytes() for g in kept)
        memory = pool._life.memory
        assert memory.free_bytes() > 0  # the first rollout's, dropped
        del kept
    assert memory.free_bytes() == 0
    del pool
    gc.collect()
    assert not [g for g in records if id(g) not in before]
