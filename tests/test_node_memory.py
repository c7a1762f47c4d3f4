"""The batch memory another process of this machine maps (the Ray backend's same-machine path)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os

import numpy as np
import pytest
from gymnasium import spaces

from envfleet.backends.ray.memory import NodeMemory, PoolMemory

OBS = spaces.Dict(
    {
        "image": spaces.Box(0, 255, shape=(3, 5), dtype=np.uint8),
        "position": spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
    }
)
ACTIONS = spaces.MultiDiscrete([3, 4])
N = 4


def _write_from_another_process(where: NodeMemory, env: int) -> None:
    batch, memory = where.attach()
    batch.observations["image"][env] = 7
    batch.observations["position"][env] = (0.5, -0.5)
    batch.rewards[env] = 2.5
    batch.truncations[env] = True
    batch.actions[env] = batch.actions[env] + 1  # reads what the pool wrote, too
    del batch
    memory.close()


def test_another_process_writes_rows_the_pool_reads() -> None:
    pool = PoolMemory(OBS, ACTIONS, N)
    try:
        pool.batch.actions[2] = (1, 2)
        child = multiprocessing.get_context("spawn").Process(
            target=_write_from_another_process, args=(pool.where, 2)
        )
        child.start()
        child.join(60)
        assert child.exitcode == 0
        batch = pool.batch
        assert (batch.observations["image"][2] == 7).all()
        assert (batch.observations["image"][[0, 1, 3]] == 0).all()
        np.testing.assert_array_equal(batch.observations["position"][2], [0.5, -0.5])
        assert batch.rewards.tolist() == [0.0, 0.0, 2.5, 0.0]
        assert batch.truncations.tolist() == [False, False, True, False]
        assert batch.actions[2].tolist() == [2, 3]
    finally:
        pool.close()


def test_memory_that_is_not_the_pools_is_refused() -> None:
    pool = PoolMemory(OBS, ACTIONS, N)
    try:
        forged = dataclasses.replace(pool.where, token=bytes(len(pool.where.token)))
        with pytest.raises(OSError, match="not the pool's"):
            forged.attach()
        elsewhere = dataclasses.replace(pool.where, pid=2**22 + 12345)  # no such process
        with pytest.raises(OSError):
            elsewhere.attach()
    finally:
        pool.close()


def test_nothing_is_named_in_dev_shm_and_close_frees_the_file() -> None:
    before = set(os.listdir("/dev/shm"))
    pool = PoolMemory(OBS, ACTIONS, N)
    assert set(os.listdir("/dev/shm")) == before
    fd = pool.where.fd
    os.fstat(fd)  # open while the pool lives
    pool.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    pool.batch.rewards[:] = 1.0  # the pool's own views stay valid after close
