"""Fault-injection hooks for :class:`tests.envs.FaultyEnv`, and a few env factories.

Everything here is a module-level function or class so that it pickles by reference under every
start method (``spawn`` included). Hooks pick their victim by the seed the env was reset with:
pools in the error tests are reset with ``seed=SEED``, so env ``i`` has ``seed_used == SEED + i``.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import gymnasium

from tests.envs import FaultyEnv

SEED = 1000
VICTIM = 3
"""Global index of the env that misbehaves (with 7 envs over 3 workers: worker 1, envs 3-4)."""
FAIL_AT_STEP = 2
"""The victim misbehaves on its ``FAIL_AT_STEP``-th step after reset."""


def _is_victim(env: FaultyEnv) -> bool:
    return env.seed_used == SEED + VICTIM


def _steps_done(env: FaultyEnv) -> int:
    return env.count - (env.seed_used or 0) * 100


class WeirdInitError(Exception):
    """Cannot be rebuilt by unpickling: its ``__init__`` takes two arguments."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"weird failure {a}/{b}")
        self.a, self.b = a, b


class LockHoldingError(Exception):
    """Cannot be pickled at all: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_value_error_in_step(env: FaultyEnv, action: Any) -> None:
    if _is_victim(env) and _steps_done(env) + 1 == FAIL_AT_STEP:
        raise ValueError(f"boom in step of env seeded {env.seed_used}")


def raise_value_error_in_reset(env: FaultyEnv) -> None:
    if _is_victim(env):
        raise ValueError(f"boom in reset of env seeded {env.seed_used}")


def raise_weird_init_error_in_step(env: FaultyEnv, action: Any) -> None:
    if _is_victim(env) and _steps_done(env) + 1 == FAIL_AT_STEP:
        raise WeirdInitError(4, 2)


def raise_lock_holding_error_in_step(env: FaultyEnv, action: Any) -> None:
    if _is_victim(env) and _steps_done(env) + 1 == FAIL_AT_STEP:
        raise LockHoldingError("a lock cannot travel")


def exit_in_step(env: FaultyEnv, action: Any) -> None:
    if _is_victim(env) and _steps_done(env) + 1 == FAIL_AT_STEP:
        os._exit(1)


def failing_factory() -> gymnasium.Env[Any, Any]:
    raise RuntimeError("this factory cannot build anything")


def factory_failing_in_workers() -> gymnasium.Env[Any, Any]:
    """Builds in the caller (so ``make`` can probe the spaces) but not in a worker process."""
    if multiprocessing.parent_process() is not None:
        raise RuntimeError("no env in worker processes")
    return FaultyEnv()


def not_an_env() -> object:
    return object()
