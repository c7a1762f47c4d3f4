"""The failure matrix: every fault x phase x policy x backend ends within a bound, in a named
error or a flagged restart, and leaves nothing behind.

:func:`test_cell` runs the table (fault: an env's exception, one that cannot be pickled, one
whose ``__str__`` raises, ``sys.exit()``, an observation of the wrong shape, ``os._exit``, a
segfault, SIGKILL, SIGSTOP, a hang; phase: make, reset, step, call, close, the rebuild of a
restart; policy: raise, restart; backend: serial, thread, process; ray in
``test_fault_matrix_ray.py``); a cell that cannot apply says why.
The autouse fixture in conftest checks that no child process and no new ``/dev/shm`` entry
remain; each cell also closes its pool twice. The tests above the table go deeper into the
step phase of the process backend and its start methods.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest

import envfleet
from envfleet.backends.contract.registry import kind_of
from envfleet.pool import DEFAULT_CLOSE_TIMEOUT
from tests import matrix_hooks as hooks
from tests import timing
from tests.envs import FaultyEnv

ACTIONS = np.ones(hooks.NUM_ENVS, dtype=np.int64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pool(on_error: str, context: str | None = None, **env: Any) -> envfleet.Pool:
    return envfleet.make(
        functools.partial(FaultyEnv, **env),
        hooks.NUM_ENVS,
        backend="process",
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        on_error=on_error,
        # A loaded machine's step may take seconds: the bound widens with what a pool costs now.
        step_timeout=timing.bound(1.0, pools=2),
        context=context,
    )


def _run(pool: envfleet.Pool, steps: int = 6) -> list[tuple[Any, ...]]:
    pool.reset()
    return [pool.step(ACTIONS) for _ in range(steps)]


def _reference(steps: int = 6) -> list[tuple[Any, ...]]:
    with envfleet.make(FaultyEnv, hooks.NUM_ENVS, backend="serial", seed=hooks.SEED) as pool:
        return _run(pool, steps)


def _close_twice(pool: envfleet.Pool) -> None:
    pool.close()
    pool.close()


STEP_FAULTS: dict[str, tuple[Callable[..., None], type[envfleet.EnvError], bool]] = {
    # name: (hook, error under "raise", whether the whole worker is lost)
    "raise": (hooks.raise_in_step, envfleet.EnvRaisedError, False),
    "unpicklable": (hooks.raise_unpicklable, envfleet.EnvRaisedError, False),
    "exit": (hooks.exit_in_step, envfleet.WorkerDiedError, True),
    "segfault": (hooks.segfault_in_step, envfleet.WorkerDiedError, True),
    "hang": (hooks.hang_in_step, envfleet.EnvTimeoutError, True),
}


@pytest.mark.parametrize("fault", list(STEP_FAULTS))
def test_step_fault_raises_a_named_error(fault: str) -> None:
    hook, error_type, worker_lost = STEP_FAULTS[fault]
    pool = _pool("raise", step_hook=hook)
    started = time.monotonic()
    with pytest.raises(error_type) as info:
        _run(pool)
    error = info.value
    assert time.monotonic() - started < 15
    assert error.phase is envfleet.Phase.STEP
    assert error.worker == 1
    if worker_lost:
        assert isinstance(error, envfleet.WorkerDiedError)
        assert error.env_ids == hooks.VICTIM_WORKER_ENVS
        assert "worker 1" in str(error)
    else:
        assert error.env_index == hooks.VICTIM
        assert f"env {hooks.VICTIM}" in str(error)
        cause = error.__cause__
        assert isinstance(cause, ValueError) or "unpicklable failure 1+2" in str(cause)
        assert isinstance(cause.__cause__, envfleet.RemoteTraceback)
        assert "matrix_hooks.py" in cause.__cause__.tb
    if fault == "segfault":
        assert "SIGSEGV" in str(error)
    # The other worker's envs finished that step: their results ride on the error.
    assert error.completed is not None
    completed_ids = set(error.completed[4]["env_id"].tolist())
    assert {0, 1, 2} <= completed_ids
    assert hooks.VICTIM not in completed_ids
    with pytest.raises(envfleet.BrokenPoolError):
        pool.step(ACTIONS)
    _close_twice(pool)


@pytest.mark.parametrize("fault", list(STEP_FAULTS))
def test_step_fault_restarts_and_the_run_goes_on(fault: str) -> None:
    hook, _, worker_lost = STEP_FAULTS[fault]
    expected = _reference()
    pool = _pool("restart", step_hook=hook)
    results = _run(pool)
    restarted = set(hooks.VICTIM_WORKER_ENVS) if worker_lost else {hooks.VICTIM}
    fault_step = hooks.FAULT_STEP - 1
    _obs, rewards, _, truncations, infos = results[fault_step]
    flagged = set(np.flatnonzero(infos.get("envfleet/restarted", np.zeros(6, bool))).tolist())
    assert flagged == restarted
    assert all(truncations[i] and rewards[i] == 0.0 for i in restarted)
    # Envs that were not restarted are untouched: identical to a fault-free run, every step.
    for step, (got, want) in enumerate(zip(results, expected, strict=True)):
        for i in sorted(set(range(6)) - restarted):
            assert got[0][i] == want[0][i] and got[1][i] == want[1][i], (step, i)
    # The restarted envs start a fresh episode on the next step (NEXT_STEP autoreset) and go on.
    assert all(not results[fault_step + 1][3][i] for i in restarted)
    assert pool.restarts[sorted(restarted)].tolist() == [1] * len(restarted)
    _close_twice(pool)


def test_reset_fault_raise_and_restart() -> None:
    pool = _pool("raise", reset_hook=hooks.raise_in_reset)
    with pytest.raises(envfleet.EnvRaisedError) as info:
        pool.reset()
    assert info.value.phase is envfleet.Phase.RESET and info.value.env_index == hooks.VICTIM
    _close_twice(pool)
    pool = _pool("restart", reset_hook=hooks.raise_in_reset)
    _obs, infos = pool.reset()
    assert infos["envfleet/restarted"].tolist() == [i == hooks.VICTIM for i in range(6)]
    pool.step(ACTIONS)
    _close_twice(pool)


@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_factory_failure_fails_make_fast(on_error: str) -> None:
    started = time.monotonic()
    with pytest.raises(envfleet.EnvError, match="license server") as info:
        envfleet.make(hooks.factory_raises, 4, backend="process", on_error=on_error)
    assert info.value.phase is envfleet.Phase.MAKE
    assert isinstance(info.value.__cause__, OSError)
    assert time.monotonic() - started < 10


_RELEASE = threading.Event()
_CLOSED: list[FaultyEnv] = []


def _hanging_constructor() -> FaultyEnv:
    """An env whose constructor hangs wherever it runs (a simulator that never answers)."""
    _RELEASE.wait(60)
    return FaultyEnv(close_hook=_CLOSED.append)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["thread", "process"])
@pytest.mark.parametrize("num_workers", [2, "auto"])
def test_a_constructor_that_hangs_in_the_caller_too_fails_make_within_start_timeout(
    where: str, num_workers: Any
) -> None:
    """``make()`` first builds one env in the caller to learn the spaces: that is bounded by
    ``start_timeout`` as well (it waited forever), and no worker is started."""
    _RELEASE.clear()
    started = time.monotonic()
    try:
        with pytest.raises(envfleet.EnvTimeoutError, match=r"start_timeout=0\.5s") as info:
            envfleet.make(
                _hanging_constructor,
                4,
                backend=where,
                num_workers=num_workers,
                step_timeout=2.0 if where == "process" else None,
                start_timeout=0.5,
            )
        assert time.monotonic() - started < timing.bound(5.0, pools=3, backend="thread")
        assert info.value.phase is envfleet.Phase.MAKE and info.value.worker == -1
        assert not psutil.Process().children()
    finally:
        _CLOSED.clear()
        _RELEASE.set()  # lets the abandoned thread end
    deadline = time.monotonic() + 5
    while not _CLOSED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _CLOSED, "the env built after make() gave up on it was never closed"


class _MainThreadEnv(FaultyEnv):
    """Installs a signal handler as it is built, which only the main thread may do."""

    def __init__(self) -> None:
        signal.signal(signal.SIGUSR2, signal.getsignal(signal.SIGUSR2))
        super().__init__()


def test_an_env_that_must_be_built_on_the_main_thread_still_makes_a_pool() -> None:
    """The bounded probe runs on a helper thread; an env that refuses one is built on the
    caller's main thread instead (its workers build it on their own main threads)."""
    for workers in (2, "auto"):
        with envfleet.make(
            _MainThreadEnv, 2, backend="process", num_workers=workers, seed=0
        ) as pool:
            assert pool.reset()[0][:, 0].tolist() == [0, 100]


@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_sigkill_from_outside_mid_step(on_error: str) -> None:
    pool = _pool(on_error, sleep=0.05)
    pool.reset()
    pool.send(ACTIONS)
    victim = psutil.Process(pool._transport.pids()[1])  # type: ignore[attr-defined]
    victim.send_signal(signal.SIGKILL)
    if on_error == "raise":
        with pytest.raises(envfleet.WorkerDiedError, match="SIGKILL"):
            pool.recv()
    else:
        infos = pool.recv()[4]
        assert infos["envfleet/restarted"][list(hooks.VICTIM_WORKER_ENVS)].all()
        pool.step(ACTIONS)
    _close_twice(pool)


def test_close_escalates_when_env_close_hangs() -> None:
    pool = _pool("raise", close_hook=hooks.hang_in_close)
    pool.reset()
    started = time.monotonic()
    pool.close(timeout=1.0)
    assert time.monotonic() - started < 1.0 + timing.bound(5.0, pools=3)
    pool.close()


def test_ctrl_c_while_envs_close_still_stops_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process: a Ctrl-C while close() waits for envs whose ``close`` hangs stops the workers
    before it goes on (the pool is closed: a second close() does nothing). The workers used to
    be left running. The interrupt is raised by the pool's wait, where a Ctrl-C lands."""
    import multiprocessing.connection

    pool = _pool("raise", close_hook=hooks.hang_in_close)
    pool.reset()
    procs = [psutil.Process(pid) for pid in pool._transport.pids()]  # type: ignore[attr-defined]

    wait = multiprocessing.connection.wait
    calls = []

    def interrupted(*args: Any, **kwargs: Any) -> list[Any]:
        calls.append(args)
        if len(calls) == 1:  # the first wait of close(); then the joins' own waits
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    monkeypatch.setattr(multiprocessing.connection, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close(timeout=30.0)
    monkeypatch.undo()
    assert pool.closed
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    pool.close()


def _ctrl_c_in_env_1(env: FaultyEnv, action: Any) -> None:
    if env.seed_used == hooks.SEED + 1 and env.count == (hooks.SEED + 1) * 100:
        raise KeyboardInterrupt  # the caller's Ctrl-C, landing while env 1 steps


def test_serial_ctrl_c_in_a_step_is_answered_not_waited_for() -> None:
    """Serial: Ctrl-C lands in an env's step, on the caller's thread. The interrupt reaches the
    caller; the interrupted command (and not the envs after it) is then a named failure: recv()
    used to wait for its reply for ever."""
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=_ctrl_c_in_env_1),
        4,
        backend="serial",
        seed=hooks.SEED,
    )
    pool.reset()
    with pytest.raises(KeyboardInterrupt):
        pool.step(np.ones(4, dtype=np.int64))
    with pytest.raises(envfleet.AlreadyPendingError):
        pool.step(np.ones(4, dtype=np.int64))
    with pytest.raises(envfleet.EnvRaisedError, match="KeyboardInterrupt during step"):
        pool.recv()
    with pytest.raises(envfleet.BrokenPoolError):
        pool.step(np.ones(4, dtype=np.int64))
    _close_twice(pool)


def _hang_in_first_step(env: FaultyEnv, action: Any) -> None:
    if env.seed_used == hooks.SEED and env.count == hooks.SEED * 100:  # env 0, its first step
        time.sleep(3600)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_a_large_command_to_a_hung_worker_waits_no_longer_than_step_timeout(on_error: str) -> None:
    """A command larger than the pipe holds, sent to a worker hung in a step: the write used to
    block the pool for good, before any wait could apply ``step_timeout``."""
    check_large_command_to_a_hung_worker("process", on_error)


def check_large_command_to_a_hung_worker(backend: str, on_error: str) -> None:
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=_hang_in_first_step),
        4,
        backend=backend,
        num_workers=2,
        seed=hooks.SEED,
        batch_size=2,
        step_timeout=timing.bound(1.0, pools=1, backend=backend),
        on_error=on_error,
    )
    pool.reset()
    pool.send(np.ones(4, dtype=np.int64))
    assert pool.recv()[4]["env_id"].tolist() == [2, 3]  # worker 1's; worker 0 hangs
    payload = np.arange(1 << 20, dtype=np.uint8)  # 1 MiB: more than a pipe holds
    started = time.monotonic()
    if on_error == "raise":
        with pytest.raises(envfleet.EnvTimeoutError) as info:
            pool.set_attr("payload", payload)
        assert info.value.worker == 0 and info.value.env_ids == (0, 1)
    else:  # worker 0 is replaced, and what it owed (the step, then the values) resent
        pool.set_attr("payload", payload)
        assert pool.recv()[4]["envfleet/restarted"].tolist() == [True, True]
        assert all(np.array_equal(value, payload) for value in pool.get_attr("payload"))
    assert time.monotonic() - started < timing.bound(10.0, pools=6, backend=backend)
    _close_twice(pool)


@pytest.mark.timeout(30)
def test_an_env_rebuild_that_hangs_is_bounded_without_step_timeout(
    tmp_path: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """An env that raised is rebuilt inside its worker; with no ``step_timeout`` nothing bounded
    that rebuild when it hung (the step waited for ever). Now ``start_timeout`` does: the worker
    process ends itself, saying where it hung, and its replacement, which hangs building the
    envs too, fails as a construction does."""
    check_rebuild_without_step_timeout("process", str(tmp_path))
    assert "most recent call first" in capfd.readouterr().err  # the stuck stack, dumped


def check_rebuild_without_step_timeout(backend: str, tmp: str) -> None:
    factory = hooks.FaultyFactory("hang", "rebuild", pool_pid=os.getpid(), tmp=tmp, in_caller=False)
    pool = envfleet.make(
        factory,
        hooks.NUM_ENVS,
        backend=backend,
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        on_error="restart",
        start_timeout=1.0 if backend == "process" else START_TIMEOUT[backend],
    )
    started = time.monotonic()
    with pytest.raises(envfleet.EnvTimeoutError) as info:
        _run(pool, steps=hooks.FAULT_STEP)
    assert time.monotonic() - started < _bound()
    assert info.value.phase is envfleet.Phase.MAKE and info.value.worker == 1
    assert info.value.env_ids == hooks.VICTIM_WORKER_ENVS
    with pytest.raises(envfleet.BrokenPoolError):
        pool.step(ACTIONS)
    _close_twice(pool)


def _refuse_to_load() -> None:
    raise RuntimeError("cannot be rebuilt in this process")


class _Unloadable:
    """Pickles in the pool; rebuilding it fails in the worker (as a class the worker cannot
    import would)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_load, ())


@pytest.mark.timeout(30)
def test_a_command_the_worker_cannot_unpickle_fails_alone() -> None:
    check_undecodable_commands("process")


def check_undecodable_commands(backend: str) -> None:
    """The worker used to die on it, and under ``"restart"`` was replaced, sent it again and
    died again, ``max_restarts`` times over: now the command fails as a whole, named."""
    with envfleet.make(
        FaultyEnv,
        hooks.NUM_ENVS,
        backend=backend,
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        on_error="restart",
    ) as pool:
        pool.reset()
        with pytest.raises(envfleet.EnvRaisedError, match="could not unpickle") as info:
            pool.set_attr("episode_length", _Unloadable())
        assert info.value.phase is envfleet.Phase.CALL
        assert "cannot be rebuilt in this process" in info.value.__cause__.__cause__.tb
        assert pool.restarts.tolist() == [0] * hooks.NUM_ENVS  # no worker died
        obs = pool.step(ACTIONS)[0]  # a failed call leaves the pool usable
        assert obs[:, 0].tolist() == [(hooks.SEED + i) * 100 + 1 for i in range(hooks.NUM_ENVS)]
        with pytest.raises(envfleet.EnvRaisedError, match="could not unpickle") as info:
            pool.reset(options={"x": _Unloadable()})
        assert info.value.phase is envfleet.Phase.RESET
        assert pool.restarts.tolist() == [0] * hooks.NUM_ENVS
        with pytest.raises(envfleet.BrokenPoolError):  # as after any failed reset
            pool.step(ACTIONS)


def test_crash_loop_hits_max_restarts() -> None:
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=hooks.raise_always),
        2,
        backend="process",
        num_workers=1,
        seed=0,
        on_error="restart",
        max_restarts=3,
    )
    pool.reset()
    with pytest.raises(envfleet.RestartLimitError, match="max_restarts=3") as info:
        for _ in range(50):
            pool.step(np.ones(2, dtype=np.int64))
    assert isinstance(info.value.__cause__, envfleet.EnvError)
    assert "crash loop" in str(info.value)
    _close_twice(pool)


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("fault", ["raise", "exit", "hang"])
def test_start_methods(context: str, fault: str) -> None:
    hook, error_type, _ = STEP_FAULTS[fault]
    pool = _pool("raise", context=context, step_hook=hook)
    with pytest.raises(error_type):
        _run(pool)
    _close_twice(pool)
    pool = _pool("restart", context=context, step_hook=hook)
    _, _, _, truncations, infos = _run(pool)[hooks.FAULT_STEP - 1]
    assert truncations[hooks.VICTIM] and infos["envfleet/restarted"][hooks.VICTIM]
    _close_twice(pool)


@pytest.mark.timeout(60)
def test_a_worker_over_its_memory_limit_is_recycled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaking env's worker is replaced between steps, its envs flagged as restarted."""
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    check_memory_recycling("process")


def _leaky_pool(
    backend: str = "process", **kwargs: Any
) -> tuple[envfleet.Pool, Callable[[int], int]]:
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=hooks.leak_and_raise_on_2),
        4,
        backend=backend,
        seed=hooks.SEED,
        worker_memory_limit=1 << 40,
        **kwargs,
    )
    return pool, pool._transport.memory  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_memory_limit_holds_under_async_when_the_worker_is_never_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One worker under send/recv always owes a reply or holds an unread result: it is
    recycled between its own commands all the same, and its memory stays within the bound the
    README gives (the limit plus what it allocates before the next check sees it and what it
    has in flight: here one command of two envs)."""
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    check_memory_limit_under_async("process")


def check_memory_limit_under_async(backend: str) -> None:
    pool, memory = _leaky_pool(backend, num_workers=1, batch_size=2)
    pool.async_reset()
    *_, infos = pool.recv()
    limit = memory(0) + 10 * hooks.LEAK
    pool.worker_memory_limit = limit
    peak, flagged = 0, 0
    for _ in range(30):
        pool.send(np.ones(2, dtype=np.int64), infos["env_id"])
        _, _, _, truncations, infos = pool.recv()
        peak = max(peak, memory(0))
        restarted = infos.get("envfleet/restarted", np.zeros(2, dtype=bool))
        assert (truncations[restarted]).all()  # a recycled env's episode ends truncated
        flagged += int(np.count_nonzero(restarted))
    recycled = pool.stats().recycled
    assert recycled >= 2, f"no recycle under async: peak {peak >> 20} MiB, limit {limit >> 20}"
    assert flagged >= 4 * (recycled - 1)  # every env of each replaced worker reported it
    assert peak <= limit + 2 * 2 * hooks.LEAK + (8 << 20), (peak >> 20, limit >> 20)
    assert pool.restarts.tolist() == [0] * 4
    _close_twice(pool)


@pytest.mark.timeout(120)
def test_memory_recycles_do_not_use_up_max_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many recycles, then a real crash under on_error="restart": the env is restarted (the
    budget counts failures only); a second crash is past max_restarts=1."""
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    pool, memory = _leaky_pool(num_workers=2, on_error="restart", max_restarts=1)
    pool.reset()
    try:
        pool.worker_memory_limit = max(memory(0), memory(1)) + 3 * hooks.LEAK
        # Each step leaks 2 * LEAK per worker, so a worker passes the limit every few steps;
        # a replacement's own resident size at start varies with what it was forked from, so
        # step until both have been recycled twice (a bound, not a count: 2 recycles each).
        for _ in range(100):
            pool.step(np.ones(4, dtype=np.int64))
            if min(w.recycled for w in pool.stats().workers) >= 2:
                break
        assert min(w.recycled for w in pool.stats().workers) >= 2, pool.stats()
        assert pool.restarts.tolist() == [0, 0, 0, 0]
        pool.worker_memory_limit = None
        pool.reset()  # whatever step the loop ended on, the next step is a real one for all
        _, _, _, truncations, infos = pool.step(np.array([2, 1, 1, 1]))  # env 0 crashes
        assert truncations[0] and infos["envfleet/restarted"][0]
        assert pool.restarts.tolist() == [1, 0, 0, 0]
        pool.step(np.ones(4, dtype=np.int64))  # the restarted env's reset (next-step autoreset)
        with pytest.raises(envfleet.RestartLimitError, match="failed 2 times"):
            pool.step(np.array([2, 1, 1, 1]))
    finally:
        _close_twice(pool)


@pytest.mark.parametrize("where", ["serial", "thread"])
def test_backends_without_worker_processes_refuse_a_memory_limit(where: str) -> None:
    """The memory row of the matrix on these backends: their envs live in the caller's own
    process, which cannot be recycled; make() says so before anything starts."""
    with pytest.raises(ValueError, match="worker_memory_limit needs a backend that can measure"):
        envfleet.make(FaultyEnv, 2, backend=where, worker_memory_limit=1 << 30)
    with envfleet.make(FaultyEnv, 2, backend=where) as pool:  # nor later, on the pool
        with pytest.raises(ValueError, match="worker_memory_limit needs a backend that can"):
            pool.worker_memory_limit = 1 << 30
        assert pool.worker_memory_limit is None


def check_memory_recycling(backend: str) -> None:
    expected = _reference(steps=8)
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=hooks.leak_in_step),
        hooks.NUM_ENVS,
        backend=backend,
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        worker_memory_limit=1 << 40,
    )
    pool.reset()
    memory = pool._transport.memory  # type: ignore[attr-defined]
    limit = max(memory(w) for w in range(hooks.NUM_WORKERS)) + (45 << 20)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), ("1G", TypeError)):
        with pytest.raises(error, match="worker_memory_limit"):
            pool.worker_memory_limit = bad  # type: ignore[assignment]
    pool.worker_memory_limit = limit  # a worker grows over it after about 5 steps
    results = [pool.step(ACTIONS) for _ in range(8)]
    flagged = [(step, _flagged(r[4])) for step, r in enumerate(results) if _flagged(r[4])]
    assert [envs for _, envs in flagged] == [set(hooks.VICTIM_WORKER_ENVS)], flagged
    assert all(results[flagged[0][0]][3][i] for i in hooks.VICTIM_WORKER_ENVS)
    stats = pool.stats()
    assert [w.recycled for w in stats.workers] == [0, 1] and stats.recycled == 1
    assert pool.restarts.tolist() == [0] * hooks.NUM_ENVS  # recycles are not restarts
    assert memory(1) < limit
    for step, (got, want) in enumerate(zip(results, expected, strict=True)):  # worker 0: as ever
        for i in range(3):
            assert got[0][i] == want[0][i], (step, i)
    _close_twice(pool)


def _script(body: str) -> list[str]:
    code = textwrap.dedent(
        f"""
        import sys, time, functools
        sys.path.insert(0, {REPO!r})
        import numpy as np, envfleet
        from tests.envs import FaultyEnv
        if __name__ == "__main__":
        """
    ) + textwrap.indent(textwrap.dedent(body), "    ")
    return [sys.executable, "-c", code]


def test_workers_exit_when_the_parent_is_killed() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        _script(
            """
            pool = envfleet.make(functools.partial(FaultyEnv, sleep=0.01), 4, num_workers=2)
            pool.reset()
            print(*pool._transport.pids(), flush=True)
            while True:
                pool.step(np.ones(4, dtype=np.int64))
            """
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.kill()
    proc.wait(10)
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, f"workers outlived their parent: {alive}"
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert proc.stderr is not None
    assert "resource_tracker" not in proc.stderr.read()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_workers_holding_the_gil_die_with_the_parent(context: str) -> None:
    """The watchdog thread cannot run while an env holds the GIL: the kernel ends the worker."""
    proc = subprocess.Popen(
        _script(
            f"""
            from tests import matrix_hooks
            env = functools.partial(FaultyEnv, step_hook=matrix_hooks.hold_the_gil)
            pool = envfleet.make(env, 2, num_workers=2, context={context!r})
            pool.reset()
            pool.step(np.ones(2, dtype=np.int64))
            pool.send(np.ones(2, dtype=np.int64))  # each worker is now stuck in the regex
            print(*pool._transport.pids(), flush=True)
            time.sleep(3600)
            """
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    assert len(workers) == 2
    # Computing (the regex) once they have read the command: a fixed sleep assumed that took
    # under half a second; on a loaded machine it may not.
    deadline = time.monotonic() + 30
    while not all(w.status() == psutil.STATUS_RUNNING for w in workers):
        assert time.monotonic() < deadline, [w.status() for w in workers]
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    # The regex runs for minutes: a worker left to its watchdog would outlive this bound.
    _gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived their parent: {alive}"


def _holds_the_gil_in_workers(caller: int) -> FaultyEnv:
    if os.getpid() != caller:  # not the probe make() builds in the caller
        re.match(r"(a*)*b", "a" * 40)  # minutes of backtracking in C, holding the GIL
    return FaultyEnv()


@pytest.mark.timeout(60)
def test_start_timeout_bounds_a_worker_constructor_that_holds_the_gil() -> None:
    """What ``start_timeout`` covers whatever the constructor does: the workers' own builds
    (killed past it). The probe ``make()`` builds in the caller is bounded only while its
    constructor lets Python run (documented in ``make``)."""
    env = functools.partial(_holds_the_gil_in_workers, os.getpid())
    with pytest.raises(envfleet.EnvTimeoutError) as info:
        envfleet.make(env, 2, num_workers=2, start_timeout=1.0)  # the workers' builds never end
    assert info.value.phase is envfleet.Phase.MAKE
    assert "start_timeout=1s" in str(info.value)


@pytest.mark.timeout(60)
def test_sigint_while_make_forks_workers_is_not_lost() -> None:
    """A Ctrl-C that lands while a worker is being forked (here: from a fork hook, the moment
    Python runs them) reaches make() as KeyboardInterrupt, and the workers already started are
    stopped. Python runs the fork hooks with any exception of theirs "ignored", so the interrupt
    used to be dropped and make() went on. (Under spawn and forkserver this process runs no
    fork hook: a Ctrl-C lands in plain Python code.)"""
    context = "fork"
    proc = subprocess.run(
        _script(
            f"""
            import os, signal, psutil
            # A terminal's state, whatever the test run leaves to its children (a blocked or
            # ignored SIGINT is inherited through exec and would make the Ctrl-C vanish).
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sent = []
            def interrupt() -> None:
                if not sent:  # the first fork in this process: worker 0's (or the fork server's)
                    sent.append(True)
                    # To this thread, at once: kill() to the process may hand the signal to
                    # another thread, which the handler then sees only later, at some other
                    # point of make() (the case the test is not about: that one raises there).
                    signal.raise_signal(signal.SIGINT)
            os.register_at_fork(after_in_parent=interrupt)
            try:
                pool = envfleet.make(FaultyEnv, 4, num_workers=2, context={context!r})
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            else:
                print("not interrupted", flush=True)
                pool.close()
            print("sent", len(sent), flush=True)
            workers = [p for p in psutil.Process().children() if "resource_tracker" not in
                       " ".join(p.cmdline()) and "forkserver" not in " ".join(p.cmdline())]
            gone, alive = psutil.wait_procs(workers, timeout=5)
            print("alive", len(alive), flush=True)
            """
        ),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.stdout.split() == ["interrupted", "sent", "1", "alive", "0"], (
        proc.stdout + proc.stderr
    )
    assert "Exception ignored" not in proc.stderr, proc.stderr


SIGINT_EXIT_BOUND = DEFAULT_CLOSE_TIMEOUT + 2 * 2 * 1.0 + 5.0
"""Seconds the script may take to exit after Ctrl-C: close()'s worst case (its timeout for the
envs, then up to 1 s each for SIGTERM and SIGKILL of each of the two workers) and 5 s for the
interpreter's exit on a loaded machine. Measured: well under 2 s, under 2-3 busy loops too."""


def test_sigint_during_step_shuts_down_cleanly() -> None:
    proc = subprocess.Popen(
        _script(
            """
            import faulthandler, signal
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks on a hang
            # A terminal's state, whatever the test run leaves to its children (a blocked or
            # ignored SIGINT is inherited through exec and would make the Ctrl-C vanish).
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            signal.signal(signal.SIGINT, signal.default_int_handler)
            with envfleet.make(functools.partial(FaultyEnv, sleep=0.2), 4, num_workers=2) as pool:
                pool.reset()
                print(*pool._transport.pids(), flush=True)
                while True:
                    pool.step(np.ones(4, dtype=np.int64))
            """
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C reaches the whole process group
    )
    assert proc.stdout is not None and proc.stderr is not None
    workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        # Both pipes drained while waiting: a script blocked writing to a full stderr pipe
        # would look like one that ignored the Ctrl-C.
        _, stderr = proc.communicate(timeout=SIGINT_EXIT_BOUND)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # where it is stuck, into its stderr
        time.sleep(1.0)
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"not exited {SIGINT_EXIT_BOUND:g} s after SIGINT; its stderr:\n{stderr}")
    assert proc.returncode != 0
    assert stderr.count("Traceback") == 1, stderr
    assert "KeyboardInterrupt" in stderr
    assert "resource_tracker" not in stderr
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive


def test_restart_keeps_other_workers_replies(tmp_path: Any) -> None:
    """Worker 1 dies and its replacement starts slowly while worker 0's reply arrives: that
    reply must reach the pool (a start-up wait that swallowed it left the pool waiting forever).
    """
    marker = str(tmp_path / "dying")
    pool = envfleet.make(
        functools.partial(
            hooks.slow_after_marker,
            marker,
            step_hook=functools.partial(hooks.exit_marking, marker=marker),
            sleep=0.1,
        ),
        hooks.NUM_ENVS,
        backend="process",
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        on_error="restart",
    )
    results = _run(pool)
    infos = results[hooks.FAULT_STEP - 1][4]
    assert infos["envfleet/restarted"].tolist() == [i >= 3 for i in range(6)]
    _close_twice(pool)


# -- the table: fault x phase x policy x backend ---------------------------------------------

MATRIX_FAULTS = hooks.ENV_FAULTS + hooks.DEATH_FAULTS + hooks.STUCK_FAULTS
PHASES = ("make", "reset", "step", "call", "close", "rebuild")
POLICIES = ("raise", "restart")
MATRIX_BACKENDS = ("serial", "thread", "process")
STEP_TIMEOUT = {"process": 1.0, "ray": 1.5}
"""Seconds for a step (reset, call): short, to keep the cells where it hangs short (a step here
takes microseconds); a Ray actor's reply goes through more processes on a loaded machine."""
START_TIMEOUT = {"thread": 2.0, "process": 2.0, "ray": 15.0}
"""Seconds for building a worker's envs: short, to keep the cells where it hangs short; Ray's
actors take longer to place on a loaded machine (8 s fell short twice, with the machine's two
cores busy with other tests too)."""
BOUND = 20.0
"""Seconds within which every cell ends (timeouts included), with slack for a loaded machine."""
# Each of these is a quiet machine's figure; the cells use it widened to what a pool's life
# costs at the time (tests/timing.py), so that a busy machine fails no cell by slowness alone.
ERRORS: dict[str, type[envfleet.EnvError]] = {
    **dict.fromkeys(hooks.ENV_FAULTS, envfleet.EnvRaisedError),
    **dict.fromkeys(hooks.DEATH_FAULTS, envfleet.WorkerDiedError),
    **dict.fromkeys(hooks.STUCK_FAULTS, envfleet.EnvTimeoutError),
}


def _bound(backend: str = "process") -> float:
    """A cell's bound: :data:`BOUND`, or ten times what a pool of ``backend`` costs now (a
    Ray pool's costs more than a process pool's, and grows more under load)."""
    return timing.bound(BOUND, pools=10, backend=backend)


def not_applicable(backend: str, fault: str, phase: str, policy: str) -> str | None:
    """Why a cell cannot apply (``None``: it does)."""
    if phase in ("make", "close") and policy == "restart":
        return "the policy does not apply: make() fails and close() never raises, either way"
    if phase == "rebuild" and policy == "raise":
        return "envs are rebuilt only under on_error='restart'"
    if fault in hooks.OBSERVATION_FAULTS and phase not in ("reset", "step"):
        return "only reset and step return an observation"
    if fault == "sigstop" and phase not in ("step", "close"):
        return "a stopped worker is a hung one to the pool: 'hang' covers this phase"
    # Asked of the backend's capabilities, not its name: a registered backend is a row too.
    can = kind_of(backend).capabilities
    in_caller = not can.step_timeout  # no worker it could kill: the envs run in this process
    if in_caller and (fault in hooks.DEATH_FAULTS or fault == "sigstop"):
        return f"the {backend} backend runs envs in the test's own process, which {fault} ends"
    if in_caller and not can.start_timeout and fault == "hang" and phase != "close":
        return f"the {backend} backend runs envs in the caller's thread: nothing takes it back"
    if in_caller and fault == "hang" and phase not in ("make", "close", "rebuild"):
        return f"a thread cannot be stopped, so the {backend} backend offers no step_timeout"
    return None


@functools.cache
def _reference_steps() -> list[tuple[Any, ...]]:
    return _reference(steps=hooks.FAULT_STEP + 2)


def matrix_pool(backend: str, fault: str, phase: str, policy: str, tmp: str) -> envfleet.Pool:
    can = kind_of(backend).capabilities
    kwargs: dict[str, Any] = {"backend": backend, "seed": hooks.SEED, "on_error": policy}
    if not can.one_worker:
        kwargs["num_workers"] = hooks.NUM_WORKERS
    if can.step_timeout:
        kwargs["step_timeout"] = timing.bound(STEP_TIMEOUT.get(backend, 1.0), pools=1)
    if can.start_timeout:
        # A Ray actor's start is widened by what a Ray pool costs now (it grows with load more
        # than a process pool's, which left 8 s short at a load average of 7).
        measured_on = "ray" if backend == "ray" else "process"
        kwargs["start_timeout"] = timing.bound(START_TIMEOUT[backend], pools=2, backend=measured_on)
    # A backend that does not bound building builds make()'s probe on the caller's own thread.
    factory = hooks.FaultyFactory(
        fault, phase, pool_pid=os.getpid(), tmp=tmp, in_caller=not can.start_timeout
    )
    return envfleet.make(factory, hooks.NUM_ENVS, **kwargs)


def check_cell(backend: str, fault: str, phase: str, policy: str, tmp: str) -> None:
    """Run one cell: bounded, the named error or flagged restarts, then a valid next step."""
    started = time.monotonic()
    expected = ERRORS[fault]
    can = kind_of(backend).capabilities
    victim_worker = 0 if can.one_worker else 1
    blamed = {hooks.VICTIM} if fault in hooks.ENV_FAULTS else set(hooks.VICTIM_WORKER_ENVS)
    if phase == "make":
        with pytest.raises(expected) as info:
            matrix_pool(backend, fault, phase, policy, tmp)
        error = info.value
        assert error.phase is envfleet.Phase.MAKE
        if not can.start_timeout:  # built by make()'s probe, in the caller's thread
            assert error.worker == -1
        else:
            assert error.worker in (0, 1), error
            assert f"worker {error.worker}" in str(error)
        assert time.monotonic() - started < _bound(backend)
        return
    pool = matrix_pool(backend, fault, phase, policy, tmp)
    reference = _reference_steps()
    if phase == "close":
        pool.reset()
        pool.step(ACTIONS)
        pool.close(timeout=1.0)
        assert time.monotonic() - started < _bound(backend)
        _close_twice(pool)
        return
    results: list[tuple[Any, ...]] = []
    try:
        if phase == "call":
            pool.reset()
            if policy == "raise" or fault in hooks.ENV_FAULTS:
                with pytest.raises(expected) as info:
                    pool.call("poke")
                _check_error(info.value, expected, envfleet.Phase.CALL, victim_worker, blamed)
                if fault not in hooks.ENV_FAULTS:  # a lost worker breaks a raising pool
                    with pytest.raises(envfleet.BrokenPoolError):
                        pool.step(ACTIONS)
                    return
            else:  # the worker was replaced and the call resent
                values = pool.call("poke")
                assert len(values) == hooks.NUM_ENVS
            results = [pool.step(ACTIONS) for _ in range(2)]
            flagged = _flagged(results[0][4])
            assert flagged == (set() if fault in hooks.ENV_FAULTS else blamed)
            for i in sorted(set(range(hooks.NUM_ENVS)) - flagged):
                assert results[1][0][i] == reference[1][0][i], i
            return
        if phase == "rebuild":
            if not can.step_timeout and fault == "hang":  # a thread's rebuild
                # Its thread is abandoned, the worker's thread serves on: that env's failure.
                expected, blamed = envfleet.EnvRaisedError, {hooks.VICTIM}
            with pytest.raises(expected) as info:
                _run(pool, steps=hooks.FAULT_STEP)
            _check_error(info.value, expected, envfleet.Phase.MAKE, victim_worker, blamed)
            with pytest.raises(envfleet.BrokenPoolError):
                pool.step(ACTIONS)
            return
        step_phase = envfleet.Phase.STEP if phase == "step" else envfleet.Phase.RESET
        if policy == "raise":
            with pytest.raises(expected) as info:
                _run(pool, steps=hooks.FAULT_STEP)
            _check_error(info.value, expected, step_phase, victim_worker, blamed)
            if info.value.completed is not None:  # the results that did come in: not the victim
                assert hooks.VICTIM not in info.value.completed[4]["env_id"].tolist()
            with pytest.raises(envfleet.BrokenPoolError):
                pool.step(ACTIONS)
            return
        _obs, infos = pool.reset()
        results = [pool.step(ACTIONS) for _ in range(hooks.FAULT_STEP + 2)]
        at = hooks.FAULT_STEP - 1 if phase == "step" else None
        flagged = _flagged(results[at][4] if at is not None else infos)
        assert flagged == blamed
        assert pool.restarts[sorted(blamed)].tolist() == [1] * len(blamed)
        # The envs that were not restarted go on exactly as in a fault-free pool.
        for step, (got, want) in enumerate(zip(results, reference, strict=False)):
            for i in sorted(set(range(hooks.NUM_ENVS)) - blamed):
                assert got[0][i] == want[0][i] and got[1][i] == want[1][i], (step, i)
    finally:
        assert time.monotonic() - started < _bound(backend)
        _close_twice(pool)


def _flagged(infos: dict[str, Any]) -> set[int]:
    mask = infos.get("envfleet/restarted", np.zeros(hooks.NUM_ENVS, bool))
    return set(np.flatnonzero(mask).tolist())


def _check_error(
    error: envfleet.EnvError,
    expected: type[envfleet.EnvError],
    phase: envfleet.Phase,
    worker: int,
    blamed: set[int],
) -> None:
    if expected is envfleet.EnvRaisedError and type(error) is not expected:
        # Raised as the env's own type too (an EnvRaisedValueError for a ValueError).
        assert type(error).__mro__[1:3] == (expected, envfleet.EnvError), error
        assert isinstance(error, type(error.__cause__)), error
    else:
        assert type(error) is expected, error
    assert error.phase is phase, error
    assert error.worker == worker, error
    if isinstance(error, envfleet.WorkerDiedError):
        # The whole worker was lost: the error names its envs (and the env in flight, if any:
        # during a call or a rebuild no one env of the worker can be blamed).
        assert error.env_ids == hooks.VICTIM_WORKER_ENVS
        assert error.env_index is None or error.env_index in blamed, error
        assert f"worker {worker}" in str(error) and str(list(error.env_ids)) in str(error)
    else:
        assert error.env_index in blamed, error
        assert f"env {error.env_index}" in str(error)


CELLS = [
    pytest.param(b, f, ph, po, id=f"{b}-{f}-{ph}-{po}")
    for b in MATRIX_BACKENDS
    for ph in PHASES
    for f in MATRIX_FAULTS
    for po in POLICIES
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("where", "fault", "phase", "policy"), CELLS)
def test_cell(where: str, fault: str, phase: str, policy: str, tmp_path: Any) -> None:
    why = not_applicable(where, fault, phase, policy)
    if why is not None:
        pytest.skip(why)
    check_cell(where, fault, phase, policy, str(tmp_path))


_REBUILD_UNDER_ARMED_FAULTHANDLER = """
import faulthandler, functools, sys
import numpy as np
import envfleet
from tests import faults
from tests.envs import FaultyEnv

faulthandler.dump_traceback_later(600, exit=True)  # the caller's own watchdog, as pytest's
pool = envfleet.make(
    functools.partial(FaultyEnv, step_hook=faults.raise_value_error_in_step),
    7, backend="process", num_workers=3, context="fork", seed=faults.SEED,
    on_error="restart", start_timeout=60.0,
)
pool.reset(seed=faults.SEED)
restarted = []
for _ in range(faults.FAIL_AT_STEP + 1):
    flags = pool.step(np.zeros(7, dtype=np.int64))[4].get("envfleet/restarted")
    restarted.append(flags is not None and bool(flags.any()))
pool.close()
faulthandler.cancel_dump_traceback_later()
print("restarted", sum(restarted), int(np.sum(pool.restarts)))
"""


@pytest.mark.timeout(120)
def test_a_forked_worker_rebuilds_while_the_callers_faulthandler_timer_runs() -> None:
    """A worker forked from a process whose ``faulthandler.dump_traceback_later`` timer runs
    (pytest's ``faulthandler_timeout``, a user's own watchdog) rebuilt a failed env for ever:
    bounding the rebuild with that timer waited for the parent's watchdog thread, which the
    fork did not copy. The bound is now the worker's own interval timer."""
    limit = timing.bound(30.0, pools=4)
    result = subprocess.run(
        [sys.executable, "-c", _REBUILD_UNDER_ARMED_FAULTHANDLER],
        capture_output=True,
        text=True,
        timeout=limit,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["restarted", "1", "1"], result.stdout + result.stderr[-3000:]
