"""Env failures reach the caller as EnvError naming env, phase and worker; the pool stays closable.

The faulty env is :data:`tests.faults.VICTIM` (env 3 of 7: worker 1 of 3 in the worker backends),
made to fail through :class:`tests.envs.FaultyEnv` hooks from :mod:`tests.faults`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import envfleet
from tests import faults
from tests.conftest import PROCESS_BACKENDS, WORKER_BACKENDS
from tests.envs import FaultyEnv

NUM_ENVS = 7
NUM_WORKERS = 3
ACTIONS = np.ones(NUM_ENVS, dtype=np.int64)
FAST = 15.0
"""Seconds within which a failure must surface (no hang; pytest's own timeout is 120 s)."""


def victim_worker(backend: str) -> int:
    return 1 if backend in WORKER_BACKENDS else 0


@pytest.fixture
def make_faulty() -> Iterator[Callable[..., envfleet.Pool]]:
    """Build pools of FaultyEnv with the given hooks; every pool is closed at the end."""
    pools: list[envfleet.Pool] = []

    def make(backend: str, **env_kwargs: Any) -> envfleet.Pool:
        pool = envfleet.make(
            FaultyEnv,
            NUM_ENVS,
            backend=backend,
            num_workers=NUM_WORKERS,
            env_kwargs=env_kwargs,
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def fail_at_step(pool: envfleet.Pool) -> pytest.ExceptionInfo[envfleet.EnvError]:
    """Reset with the faults' seed; take good steps up to the failing one; return its error."""
    pool.reset(seed=faults.SEED)
    for _ in range(faults.FAIL_AT_STEP - 1):
        pool.step(ACTIONS)
    start = time.monotonic()
    with pytest.raises(envfleet.EnvError) as info:
        pool.step(ACTIONS)
    assert time.monotonic() - start < FAST
    return info


def assert_broken_but_closable(pool: envfleet.Pool) -> None:
    """After a failure only close() is allowed, and it works (twice)."""
    with pytest.raises(envfleet.BrokenPoolError, match="broken"):
        pool.step(ACTIONS)
    with pytest.raises(envfleet.BrokenPoolError):
        pool.reset()
    start = time.monotonic()
    pool.close()
    pool.close()
    assert pool.closed
    assert time.monotonic() - start < FAST
    with pytest.raises(envfleet.ClosedPoolError):
        pool.step(ACTIONS)


def test_step_raising_gives_env_error(backend: str, make_faulty: Any) -> None:
    pool = make_faulty(backend, step_hook=faults.raise_value_error_in_step)
    err = fail_at_step(pool).value
    assert isinstance(err, envfleet.EnvRaisedError)
    assert err.env_index == faults.VICTIM
    assert err.phase is envfleet.Phase.STEP
    assert err.worker == victim_worker(backend)
    message = str(err)
    assert f"env {faults.VICTIM}" in message
    assert "step" in message
    assert "ValueError" in message and "boom in step" in message
    cause = err.__cause__
    assert isinstance(cause, ValueError)
    assert str(cause) == f"boom in step of env seeded {faults.SEED + faults.VICTIM}"
    remote = cause.__cause__
    assert isinstance(remote, envfleet.RemoteTraceback)
    assert "raise_value_error_in_step" in remote.tb
    assert "ValueError: boom in step" in remote.tb
    assert "raise_value_error_in_step" in str(remote)
    assert_broken_but_closable(pool)


def test_reset_raising_gives_env_error(backend: str, make_faulty: Any) -> None:
    pool = make_faulty(backend, reset_hook=faults.raise_value_error_in_reset)
    start = time.monotonic()
    with pytest.raises(envfleet.EnvRaisedError) as info:
        pool.reset(seed=faults.SEED)
    assert time.monotonic() - start < FAST
    err = info.value
    assert err.env_index == faults.VICTIM
    assert err.phase is envfleet.Phase.RESET
    assert err.worker == victim_worker(backend)
    assert f"env {faults.VICTIM}" in str(err) and "reset" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert isinstance(err.__cause__.__cause__, envfleet.RemoteTraceback)
    assert "raise_value_error_in_reset" in err.__cause__.__cause__.tb
    assert_broken_but_closable(pool)


@pytest.mark.parametrize(
    ("hook", "type_name", "text"),
    [
        (faults.raise_weird_init_error_in_step, "WeirdInitError", "weird failure 4/2"),
        (faults.raise_lock_holding_error_in_step, "LockHoldingError", "a lock cannot travel"),
    ],
    ids=["custom-init", "holds-a-lock"],
)
def test_exception_that_cannot_travel_still_arrives_with_its_text(
    backend: str, make_faulty: Any, hook: Any, type_name: str, text: str
) -> None:
    pool = make_faulty(backend, step_hook=hook)
    err = fail_at_step(pool).value
    assert isinstance(err, envfleet.EnvRaisedError)
    assert err.env_index == faults.VICTIM and err.phase is envfleet.Phase.STEP
    assert type_name in str(err) and text in str(err)
    cause = err.__cause__
    if isinstance(cause, envfleet.RemoteError):
        assert cause.type_name == type_name
        assert cause.message == text
    else:  # rebuilt after all (a backend that shares memory need not pickle)
        assert type(cause).__name__ == type_name and str(cause) == text
    assert isinstance(cause.__cause__, envfleet.RemoteTraceback)
    assert type_name in cause.__cause__.tb and hook.__name__ in cause.__cause__.tb
    assert_broken_but_closable(pool)


@pytest.mark.parametrize("worker_backend", PROCESS_BACKENDS)  # os._exit would end this process
def test_worker_exiting_gives_worker_died_error(worker_backend: str, make_faulty: Any) -> None:
    pool = make_faulty(worker_backend, step_hook=faults.exit_in_step)
    err = fail_at_step(pool).value
    assert isinstance(err, envfleet.WorkerDiedError)
    assert err.worker == 1
    assert err.env_ids == (3, 4)
    assert err.env_index in (3, 4)
    assert err.phase is envfleet.Phase.STEP
    message = str(err)
    assert "worker 1" in message and "[3, 4]" in message
    assert err.exitcode in (1, None)  # None: the backend cannot know it (a Ray actor)
    if err.exitcode is not None:
        assert "exit code 1" in message
    assert_broken_but_closable(pool)


@pytest.mark.parametrize("worker_backend", PROCESS_BACKENDS)
def test_killed_worker_gives_worker_died_error(worker_backend: str, make_faulty: Any) -> None:
    pool = make_faulty(worker_backend)
    pool.reset(seed=0)
    pids = pool.get_attr("pid")
    os.kill(pids[5], signal.SIGKILL)  # a worker of this pool: envs 5 and 6 live in it
    start = time.monotonic()
    with pytest.raises(envfleet.WorkerDiedError) as info:
        pool.step(ACTIONS)
    assert time.monotonic() - start < FAST
    err = info.value
    assert err.worker == 2 and err.env_ids == (5, 6) and err.env_index in (5, 6)
    assert err.phase is envfleet.Phase.STEP
    assert "worker 2" in str(err) and "[5, 6]" in str(err)
    assert_broken_but_closable(pool)


def test_factory_that_raises_fails_make_fast(backend: str) -> None:
    start = time.monotonic()
    with pytest.raises(envfleet.EnvError, match="cannot build anything") as info:
        envfleet.make(faults.failing_factory, NUM_ENVS, backend=backend, num_workers=NUM_WORKERS)
    assert time.monotonic() - start < FAST
    assert info.value.phase is envfleet.Phase.MAKE
    assert "failing_factory" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("worker_backend", PROCESS_BACKENDS)  # it fails in child processes
def test_factory_that_raises_in_workers_fails_make_fast(worker_backend: str) -> None:
    start = time.monotonic()
    with pytest.raises(envfleet.EnvError, match="no env in worker processes") as info:
        envfleet.make(
            faults.factory_failing_in_workers,
            NUM_ENVS,
            backend=worker_backend,
            num_workers=NUM_WORKERS,
        )
    assert time.monotonic() - start < FAST
    assert info.value.phase is envfleet.Phase.MAKE
    assert info.value.env_index in range(NUM_ENVS)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(info.value.__cause__.__cause__, envfleet.RemoteTraceback)


def test_factory_that_returns_no_env_fails_make(backend: str) -> None:
    with pytest.raises(envfleet.EnvError, match=r"expected a gymnasium\.Env") as info:
        envfleet.make(faults.not_an_env, 2, backend=backend)
    assert info.value.phase is envfleet.Phase.MAKE


def test_failing_call_names_the_env_and_leaves_the_pool_usable(
    backend: str, make_faulty: Any
) -> None:
    pool = make_faulty(backend)
    pool.reset(seed=0)
    with pytest.raises(envfleet.EnvRaisedError, match="no_such_attribute") as info:
        pool.get_attr("no_such_attribute")
    assert info.value.phase is envfleet.Phase.CALL
    assert info.value.env_index == 0
    assert isinstance(info.value.__cause__, AttributeError)
    obs, *_ = pool.step(ACTIONS)  # a failed call is not an env failure
    np.testing.assert_array_equal(obs[:, 0], [i * 100 + 1 for i in range(NUM_ENVS)])


class _OwnBaseError(BaseException):
    """A library's own ``BaseException`` (as trio's ``Cancelled`` or gevent's ``GreenletExit``)."""


THREAD_BASE_EXCEPTIONS = (KeyboardInterrupt, GeneratorExit, _OwnBaseError)


def _interrupt_in_step(kind: type[BaseException], env: FaultyEnv, action: Any) -> None:
    if env.seed_used == 1 and env.count == 101:  # env 1's second step, once
        raise kind


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", THREAD_BASE_EXCEPTIONS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("backend_name", WORKER_BACKENDS)
def test_any_base_exception_raised_by_an_env_in_a_worker_is_that_envs_failure(
    backend_name: str, kind: type[BaseException]
) -> None:
    """Not a Ctrl-C (that reaches the caller's main thread only, and a worker process ignores
    SIGINT): a failure of the env, not a dead worker (a process worker used to die of it, the
    error naming env 0 as a ``WorkerDiedError``) nor a dead worker thread that would leave
    ``step()`` waiting forever (or, a thread worker being irreplaceable, break a pool that
    should restart the env). The ray backend has the same test in ``test_ray.py``."""
    env = functools.partial(FaultyEnv, step_hook=functools.partial(_interrupt_in_step, kind))
    actions = np.zeros(2, dtype=np.int64)
    with envfleet.make(env, 2, backend=backend_name, seed=0) as pool:
        pool.reset()
        pool.step(actions)
        with pytest.raises(envfleet.EnvRaisedError) as info:
            pool.step(actions)
    assert info.value.env_index == 1 and info.value.phase is envfleet.Phase.STEP
    assert isinstance(info.value.__cause__, kind)
    with envfleet.make(env, 2, backend=backend_name, seed=0, on_error="restart") as pool:
        pool.reset()
        results = [pool.step(actions) for _ in range(3)]
        assert results[1][4]["envfleet/restarted"].tolist() == [False, True]
        assert results[1][3].tolist() == [False, True]
        assert pool.restarts.tolist() == [0, 1]
        assert results[2][0][0, 0] == 3  # env 0 goes on untouched


# -- the error is of the env's own exception type too (as Gymnasium re-raises it) -------------


@pytest.mark.parametrize(
    ("cause", "combined"),
    [
        (KeyError("missing"), True),
        (FileNotFoundError(2, "no such file"), True),
        (NotImplementedError("later"), True),
        (RuntimeError("plain"), False),  # an EnvError is a RuntimeError already
        (SystemExit(3), False),  # never make the pool's error a BaseException-only type
        (StopIteration("done"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_env_raised_error_is_of_the_causes_type(cause: BaseException, combined: bool) -> None:
    from envfleet.errors import env_raised_error

    error = env_raised_error(
        "env 2 raised it", cause, env_index=2, phase=envfleet.Phase.STEP, worker=1
    )
    assert isinstance(error, envfleet.EnvRaisedError) and isinstance(error, RuntimeError)
    assert isinstance(error, type(cause)) is (combined or isinstance(cause, RuntimeError))
    assert (type(error) is not envfleet.EnvRaisedError) is combined
    assert error.__cause__ is cause
    assert (error.env_index, error.phase, error.worker) == (2, envfleet.Phase.STEP, 1)
    assert str(error) == "env 2 raised it"  # not quoted, as KeyError's own str would be
    again = env_raised_error("x", type(cause)(), env_index=0, phase=envfleet.Phase.STEP, worker=0)
    assert type(again) is type(error)  # one class per exception type
