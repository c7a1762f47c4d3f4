"""Faults for the failure matrix: each hook hits one victim env, once, at a chosen step.

The victim is the env reset with seed ``SEED + VICTIM``; a restarted env is reset with a derived
seed, so the fault does not follow it (except :func:`raise_always`, the crash loop).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import time
from typing import Any

from tests.envs import FaultyEnv

SEED = 500
NUM_ENVS = 6
NUM_WORKERS = 2  # worker 0: envs 0-2, worker 1: envs 3-5
VICTIM = 4
VICTIM_WORKER_ENVS = (3, 4, 5)
FAULT_STEP = 3  # the victim misbehaves on its third step


def _hit(env: FaultyEnv) -> bool:
    return env.seed_used == SEED + VICTIM and env.count == (SEED + VICTIM) * 100 + FAULT_STEP - 1


def raise_in_step(env: FaultyEnv, action: Any) -> None:
    if _hit(env):
        raise ValueError("injected failure in step")


def raise_in_reset(env: FaultyEnv) -> None:
    if env.seed_used == SEED + VICTIM and env.count == 0:  # the first reset only
        raise ValueError("injected failure in reset")


class UnpicklableError(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"unpicklable failure {a}+{b}")


def raise_unpicklable(env: FaultyEnv, action: Any) -> None:
    if _hit(env):
        raise UnpicklableError(1, 2)


def exit_in_step(env: FaultyEnv, action: Any) -> None:
    if _hit(env):
        os._exit(1)


def segfault_in_step(env: FaultyEnv, action: Any) -> None:
    if _hit(env):
        # A deliberate crash: no "Fatal Python error" dump (pytest turns faulthandler on, and
        # forked workers inherit it), so that a test log shows only real crashes.
        faulthandler.disable()
        ctypes.string_at(0)


def hang_in_step(env: FaultyEnv, action: Any) -> None:
    if _hit(env):
        time.sleep(3600)


def hang_in_close(env: FaultyEnv) -> None:
    if env.seed_used is not None:  # an env that was used (not the probe make() builds)
        time.sleep(3600)


def raise_always(env: FaultyEnv, action: Any) -> None:
    if env.count >= 2:  # every env instance, restarted or not: a crash loop
        raise RuntimeError("crash loop")


def factory_raises() -> FaultyEnv:
    raise OSError("simulator license server unreachable")


def exit_marking(env: FaultyEnv, action: Any, *, marker: str) -> None:
    """The victim leaves ``marker`` behind and exits (see :func:`slow_after_marker`)."""
    if _hit(env):
        with open(marker, "w"):
            pass
        os._exit(1)


def slow_after_marker(marker: str, **kwargs: Any) -> FaultyEnv:
    """A factory that takes 0.5 s once ``marker`` exists: the replacement worker starts slowly."""
    if os.path.exists(marker):
        time.sleep(0.5)
    return FaultyEnv(**kwargs)
