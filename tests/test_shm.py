"""A batch that ``/dev/shm`` has no room for (Docker's 64 MB): memfd memory, not a disk file.

The free space of ``/dev/shm`` is simulated (:func:`envfleet.backends.local.shm.free_bytes`);
the pool must then give the same results as with room, under ``fork`` and ``spawn`` (whose
workers get the memory as passed descriptors), from memory that is neither in ``/dev/shm`` nor
in the temp dir. Without memfd, one warning names the size and Docker's ``--shm-size``.
"""

from __future__ import annotations

import multiprocessing.heap
import os
import re
import warnings
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet.backends.local import shm
from tests.envs import FaultyEnv

NUM_ENVS = 4
ACTIONS = np.ones(NUM_ENVS, dtype=np.int64)


def _run(**kwargs: Any) -> list[np.ndarray]:
    with envfleet.make(FaultyEnv, NUM_ENVS, num_workers=2, seed=0, **kwargs) as pool:
        out = [pool.reset()[0]]
        out += [pool.step(ACTIONS)[0] for _ in range(3)]
        return out


def _memory_files() -> list[str]:
    """This process's open descriptors on batch memory from memfd."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if "memfd:envfleet-batch" in link]


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_batch_that_dev_shm_has_no_room_for_goes_to_memfd(
    monkeypatch: pytest.MonkeyPatch, context: str
) -> None:
    expected = _run(backend="serial")
    monkeypatch.setattr(shm, "free_bytes", lambda directory=shm.SHM_DIR: 0)
    chosen: list[str] = []

    def no_temp_dir(self: Any, size: int) -> str:  # multiprocessing's fallback: a temp file
        chosen.append("temp dir")
        raise AssertionError("the batch went to a file in the temp dir")

    monkeypatch.setattr(multiprocessing.heap.Arena, "_choose_dir", no_temp_dir)
    before = _memory_files()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # memfd is as fast as /dev/shm: nothing to warn about
        with envfleet.make(FaultyEnv, NUM_ENVS, num_workers=2, seed=0, context=context) as pool:
            assert len(_memory_files()) > len(before)
            got = [pool.reset()[0]] + [pool.step(ACTIONS)[0] for _ in range(3)]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert chosen == []


def test_without_memfd_a_full_dev_shm_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "free_bytes", lambda directory=shm.SHM_DIR: 0)
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setattr(shm, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"--shm-size") as record:
        first = _run(context="fork")
    assert len(record) == 1
    assert re.match(
        r"/dev/shm has 0 bytes free, less than the pool's \d+ bytes", str(record[0].message)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _run(context="fork")  # said once per process
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_with_room_the_batch_stays_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "free_bytes", lambda directory=shm.SHM_DIR: 1 << 40)
    ctx = multiprocessing.get_context("fork")
    assert shm.batch_allocator(ctx, 1 << 20) is ctx
