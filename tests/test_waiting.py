"""When the process backend's pool polls for replies without sleeping (``SPIN_LIMIT``): for the
last replies of a wait once fewer workers owe one than there are cores, and at the start of a
wait whose previous wait was that short, never on one core nor on a busy machine; otherwise it
sleeps in the kernel."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet.backends.local import spin
from tests.envs import FaultyEnv


class _Logged:
    """A ``select.poll`` object that records, wait by wait, each call's timeout and whether it
    returned events."""

    def __init__(self, poller: Any, waits: list[list[tuple[int | None, bool]]]) -> None:
        self._poller, self._waits = poller, waits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)

    def poll(self, timeout: int | None = None) -> list[tuple[int, int]]:
        events: list[tuple[int, int]] = self._poller.poll(timeout)
        self._waits[-1].append((timeout, bool(events)))
        return events


def _logged_pool(
    env_fns: list[Any], cores: int, runnable: int = 1
) -> tuple[Any, list[list[tuple[int | None, bool]]]]:
    """A process pool of ``env_fns`` on one worker each, its polls logged wait by wait, as if
    the machine had ``cores`` usable cores and ``runnable`` tasks running or queued for one
    (1, the default: nothing but the pool itself, as on an idle machine)."""
    pool = envfleet.make(env_fns, backend="process", num_workers=len(env_fns))
    transport = pool._transport
    waits: list[list[tuple[int | None, bool]]] = [[]]
    transport._poller = _Logged(transport._poller, waits)
    transport._cores = cores
    transport._runnable.count = lambda: runnable
    wait = transport.wait

    def logged_wait(*args: Any, **kwargs: Any) -> Any:
        waits.append([])
        return wait(*args, **kwargs)

    transport.wait = logged_wait
    return pool, waits


def _five_steps(
    pool: Any, waits: list[list[tuple[int | None, bool]]]
) -> tuple[list[list[tuple[int | None, bool]]], list[int | None]]:
    """Five sync steps of two envs: each step's polls, and every poll's timeout."""
    del waits[:]
    for _ in range(5):
        waits.append([])
        pool.step(np.zeros(2, dtype=np.int64))
    steps = [polls for polls in waits if polls]
    assert len(steps) >= 5
    return steps, [timeout for step in steps for timeout, _ in step]


@pytest.fixture
def spin_limit(request: pytest.FixtureRequest) -> Iterator[float]:
    """``spin.SPIN_LIMIT`` set to the test's parameter for its duration."""
    old, spin.SPIN_LIMIT = spin.SPIN_LIMIT, request.param
    yield request.param
    spin.SPIN_LIMIT = old


@pytest.mark.parametrize("spin_limit", [0.0002], indirect=True)
def test_slow_envs_sleep_in_the_kernel_and_spin_only_for_the_last_reply(spin_limit: float) -> None:
    """Env 1 sleeps 30 ms a step, env 0 not at all (one worker each, 2 cores): every wait after
    the first step starts blocking (its previous wait was far longer than the limit); once env
    0's worker has answered, one worker owes a reply with 2 cores: the pool polls without
    sleeping, then blocks again for env 1 (30 ms is past the limit)."""
    fns = [functools.partial(FaultyEnv, sleep=s, episode_length=1000) for s in (0.0, 0.03)]
    pool, waits = _logged_pool(fns, cores=2)
    try:
        pool.reset(seed=0)
        pool.step(np.zeros(2, dtype=np.int64))  # after the reset's quick wait: spins first
        del waits[:]
        for _ in range(6):
            waits.append([])
            pool.step(np.zeros(2, dtype=np.int64))
        steps = [polls for polls in waits if polls]
        assert steps
        for polls in steps:
            first_reply = next(k for k, (_, got) in enumerate(polls) if got)
            assert all(timeout != 0 for timeout, _ in polls[: first_reply + 1]), polls
        tails = [
            polls
            for polls in steps
            if any(timeout == 0 for timeout, _ in polls)  # spun after the first reply...
            and polls[-1][0] != 0  # ...then slept for the slow one
        ]
        assert tails, steps
    finally:
        pool.close()


@pytest.mark.parametrize("spin_limit", [5.0], indirect=True)
@pytest.mark.parametrize("cores", [2, 1])
def test_fast_envs_are_waited_for_without_sleeping_unless_on_one_core(
    spin_limit: float, cores: int
) -> None:
    """With the limit past any step of two counter envs, every wait after the first starts by
    polling without sleeping, and gets its replies that way; on one core (a node agent on a
    node Ray gives one CPU) none does: the spin would hold the only core the workers need."""
    pool, waits = _logged_pool([FaultyEnv, FaultyEnv], cores=cores)
    try:
        pool.reset(seed=0)
        pool.step(np.zeros(2, dtype=np.int64))
        steps, polls = _five_steps(pool, waits)
        assert all((timeout == 0) == (cores > 1) for timeout in polls), steps
    finally:
        pool.close()


@pytest.mark.parametrize("spin_limit", [5.0], indirect=True)
def test_no_spin_while_every_core_has_a_busy_worker(spin_limit: float) -> None:
    """With as many workers owing a reply as cores (1 core here), a wait whose previous wait
    was slow blocks until the first reply and, the other worker still owing one, goes on
    blocking: the spin would take a core a worker needs."""
    fns = [functools.partial(FaultyEnv, sleep=0.2, episode_length=1000)] * 2
    pool, waits = _logged_pool(fns, cores=1)
    try:
        pool.reset(seed=0)
        spin.SPIN_LIMIT = 0.0002  # the reset and this step: slower than the limit
        pool.step(np.zeros(2, dtype=np.int64))
        spin.SPIN_LIMIT = spin_limit
        del waits[:]
        waits.append([])
        pool.step(np.zeros(2, dtype=np.int64))
        polls = [call for wait in waits for call in wait]
        assert polls and all(timeout != 0 for timeout, _ in polls), polls
    finally:
        pool.close()


@pytest.mark.parametrize("spin_limit", [5.0], indirect=True)
@pytest.mark.parametrize("runnable", [3, 4, 50])
def test_no_spin_while_the_machine_has_more_to_run_than_the_pool_and_its_cores(
    spin_limit: float, runnable: int
) -> None:
    """Two fast workers on 2 cores, whose waits would all spin on an idle machine (above): with
    more tasks running or queued for a core than the pool's own (itself and its 2 workers,
    which may all be running around a wait: the last to reply still finishing) and than the
    cores, the pool sleeps in the kernel instead, so that it does not hold a core others are
    queued for."""
    pool, waits = _logged_pool([FaultyEnv, FaultyEnv], cores=2, runnable=runnable)
    try:
        pool.reset(seed=0)
        pool._transport._quick = True  # the previous wait was quick: the start may spin
        steps, polls = _five_steps(pool, waits)
        if runnable <= 3:
            assert all(timeout == 0 for timeout in polls), steps
        else:
            assert all(timeout != 0 for timeout in polls), steps
    finally:
        pool.close()


@pytest.mark.parametrize("spin_limit", [5.0], indirect=True)
@pytest.mark.parametrize("runnable", [3, 4])
def test_more_workers_than_cores_count_as_many_as_the_cores_against_the_machine(
    spin_limit: float, runnable: int
) -> None:
    """Four fast workers on 2 cores: the pool counts as its own tasks itself and 2 of its
    workers (a spin waits on fewer workers than cores), not all four, so that one task more on
    the machine (4 running or queued) makes it sleep in the kernel; with 3 it spins."""
    pool, waits = _logged_pool([FaultyEnv] * 4, cores=2, runnable=runnable)
    try:
        pool.reset(seed=0)
        del waits[:]
        for _ in range(5):
            pool._transport._quick = True  # each wait may spin from its start
            waits.append([])
            pool.step(np.zeros(4, dtype=np.int64))
        polls = [timeout for wait in waits for timeout, _ in wait]
        assert polls
        assert (0 in polls) == (runnable <= 3), waits
    finally:
        pool.close()


@pytest.mark.parametrize("spin_limit", [0.0002], indirect=True)
@pytest.mark.parametrize("yields_after", [20e-6, 1.0])
def test_a_spin_past_its_first_microseconds_yields_the_core(
    spin_limit: float, yields_after: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Env 1 sleeps 30 ms a step, env 0 not at all: once env 0's worker has answered, the pool
    spins the whole limit for env 1; past ``SPIN_YIELDS_AFTER`` of it, each empty poll gives
    the core away (``sched_yield``), since the pool may sit on the core of the worker it waits
    for; a spin that ends within it (here: yielding only after 1 s) never yields."""
    yielded: list[None] = []
    monkeypatch.setattr(spin.os, "sched_yield", lambda: yielded.append(None))
    monkeypatch.setattr(spin, "SPIN_YIELDS_AFTER", yields_after)
    fns = [functools.partial(FaultyEnv, sleep=s, episode_length=1000) for s in (0.0, 0.03)]
    pool, waits = _logged_pool(fns, cores=2)
    try:
        pool.reset(seed=0)
        del yielded[:]
        steps, polls = _five_steps(pool, waits)
        assert 0 in polls, steps  # the tails spun
        assert bool(yielded) == (yields_after < spin_limit), len(yielded)
    finally:
        pool.close()
