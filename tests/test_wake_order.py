"""The order a sync step's commands go out in (``envfleet.backends.local.wake_order``): workers last
seen on another core than the pool's thread first, those on its core last; the workers really
note their CPU; quick steps and unknown CPUs keep the workers' own order."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.backends.local import wake_order
from tests.envs import FaultyEnv


def _slots(raw: Any) -> np.ndarray:
    return np.ndarray((len(raw) // 4,), np.int32, buffer=raw)


def test_the_workers_on_the_callers_cpu_go_last(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = wake_order.allocate(multiprocessing.get_context(), 4)
    order = wake_order.WakeOrder(raw, 4)
    assert list(order.order()) == [0, 1, 2, 3]  # nothing noted yet
    _slots(raw)[:] = [3, 5, 3, 7]
    monkeypatch.setattr(wake_order, "current_cpu", lambda: 3)
    assert list(order.order()) == [1, 3, 0, 2]
    monkeypatch.setattr(wake_order, "current_cpu", lambda: 5)
    assert list(order.order()) == [0, 2, 3, 1]
    monkeypatch.setattr(wake_order, "current_cpu", lambda: 1)  # on no worker's CPU
    assert list(order.order()) == [0, 1, 2, 3]
    _slots(raw)[:] = -1
    monkeypatch.setattr(wake_order, "current_cpu", lambda: -1)  # not readable: as they are
    assert list(order.order()) == [0, 1, 2, 3]


def test_a_worker_notes_its_cpu_and_composes_with_another_hook() -> None:
    if wake_order.current_cpu() < 0:
        pytest.skip("sched_getcpu is not available here")
    raw = wake_order.allocate(multiprocessing.get_context(), 3)
    _slots(raw)[:] = -1
    calls: list[str] = []
    note = wake_order.then(lambda: calls.append("copy"), wake_order.noter(raw, 2))
    assert note is not None
    note()
    assert calls == ["copy"]
    assert _slots(raw)[2] in usable_cpus() and list(_slots(raw)[:2]) == [-1, -1]
    assert wake_order.then(None, None) is None
    only = wake_order.noter(raw, 0)
    assert wake_order.then(None, only) is only


def test_a_sync_step_writes_last_to_the_worker_on_the_pools_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if len(usable_cpus()) < 2 or wake_order.current_cpu() < 0:
        pytest.skip("needs 2 usable CPUs and sched_getcpu")
    first, second = usable_cpus()[:2]
    before = os.sched_getaffinity(0)
    # Worker 0 runs on CPU ``first``, worker 1 on ``second``, and the pool's thread (this one)
    # on ``first``: worker 1's command goes first.
    pool = envfleet.make(
        [FaultyEnv] * 4, backend="process", num_workers=2, cpu_affinity=[[first], [second]]
    )
    transport = pool._transport
    sent: list[int] = []
    submit = transport.submit

    def logged(worker: int, command: Any) -> None:
        sent.append(worker)
        submit(worker, command)

    transport.submit = logged
    # The sync step's repeat byte is written straight to the command pipe (its hot path): those
    # writes are logged as well.
    worker_of = {slot.command_fd: w for w, slot in enumerate(transport._workers)}
    write = os.write

    def written(fd: int, data: Any) -> int:
        if fd in worker_of:
            sent.append(worker_of[fd])
        return write(fd, data)

    monkeypatch.setattr(os, "write", written)
    os.sched_setaffinity(0, {first})
    try:
        pool.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        pool.step(actions)  # the workers note their CPUs as they answer
        assert list(_slots(transport._wake_mem)) == [first, second]
        sent.clear()
        for _ in range(3):
            transport._quick = False  # steps of a slow env: the order applies
            pool.step(actions)
        assert sent == [1, 0] * 3
        os.sched_setaffinity(0, {second})  # the pool's thread moves to worker 1's core
        sent.clear()
        transport._quick = False
        pool.step(actions)
        assert sent == [0, 1]
        os.sched_setaffinity(0, {first})
        sent.clear()
        transport._quick = True  # quick steps: the workers' own order
        pool.step(actions)
        assert sent == [0, 1]
    finally:
        os.sched_setaffinity(0, before)
        pool.close()
