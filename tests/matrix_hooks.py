"""Faults for the failure matrix: each hook hits one victim env, once, at a chosen step.

The victim is the env reset with seed ``SEED + VICTIM``; a restarted env is reset with a derived
seed, so the fault does not follow it (except :func:`raise_always`, the crash loop).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

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


# -- the table-driven matrix (test_fault_matrix.test_cell) -------------------------------------

ENV_FAULTS = ("raise", "unpicklable", "broken_str", "base_exception", "wrong_obs")
"""Faults the env's own code raises: the env fails, its worker lives."""
DEATH_FAULTS = ("exit", "segfault", "sigkill")
"""Faults that end the worker's process."""
STUCK_FAULTS = ("sigstop", "hang")
"""Faults that leave the worker without an answer: only a timeout ends them."""


class LockHoldingError(Exception):
    """Cannot be pickled at all: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class BrokenStrError(Exception):
    """An exception whose ``__str__`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ fails")


OBSERVATION_FAULTS = ("wrong_obs",)
"""Faults in what the env returns rather than in how it runs: only reset and step return one."""


def misbehave(kind: str) -> Any:
    """Do what fault ``kind`` stands for, here and now (or return the wrong observation)."""
    if kind == "wrong_obs":
        return np.zeros(3, dtype=np.int64)  # the space is Box(shape=(1,)): (3,) cannot fit
    if kind == "raise":
        raise ValueError("injected failure")
    if kind == "unpicklable":
        raise LockHoldingError("a lock cannot travel")
    if kind == "broken_str":
        raise BrokenStrError()
    if kind == "base_exception":
        sys.exit(3)
    if kind == "exit":
        os._exit(1)
    if kind == "segfault":
        faulthandler.disable()  # a deliberate crash: no "Fatal Python error" dump in the log
        ctypes.string_at(0)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "hang":
        time.sleep(3600)
    raise AssertionError(f"unknown fault {kind}")


class Fault:
    """A hook of :class:`FaultyEnv` (reset, step, call or close): the victim misbehaves once.

    ``once``: a file written as the fault fires; it fires only while that file is absent (so
    that a resent command, on a rebuilt worker, goes through). ``marker``: a file written
    too, from which on the factory misbehaves (the restart-rebuild phase).
    """

    def __init__(self, kind: str, phase: str, once: str, marker: str | None = None) -> None:
        self.kind, self.phase, self.once, self.marker = kind, phase, once, marker

    def __call__(self, env: FaultyEnv, *action: Any) -> Any:
        if env.seed_used != SEED + VICTIM or os.path.exists(self.once):
            return None
        if self.phase == "step" and not _hit(env):
            return None
        for path in (self.once, self.marker):
            if path is not None:
                with open(path, "w"):
                    pass
        return misbehave(self.kind)


class FaultyFactory:
    """Builds :class:`FaultyEnv` with fault ``kind`` in ``phase``, or at construction itself:
    ``make``: in the pool's workers (not the probe ``make()`` builds in the caller, on its
    ``envfleet-probe`` thread, unless ``in_caller``); ``rebuild``: the victim raises in a step,
    and every build after that misbehaves."""

    def __init__(self, kind: str, phase: str, *, pool_pid: int, tmp: str, in_caller: bool) -> None:
        self.kind, self.phase, self.pool_pid, self.in_caller = kind, phase, pool_pid, in_caller
        self.once = os.path.join(tmp, "fired")
        self.marker = os.path.join(tmp, "rebuild")

    def __call__(self) -> FaultyEnv:
        thread = threading.current_thread()
        in_worker = os.getpid() != self.pool_pid or (
            thread is not threading.main_thread() and thread.name != "envfleet-probe"
        )
        if self.phase == "make" and (in_worker or self.in_caller):
            misbehave(self.kind)
        if self.phase == "rebuild":
            if os.path.exists(self.marker):
                misbehave(self.kind)
            return FaultyEnv(step_hook=Fault("raise", "step", self.once, self.marker))
        hook = Fault(self.kind, self.phase, self.once)
        return FaultyEnv(
            step_hook=hook if self.phase == "step" else None,
            reset_hook=hook if self.phase == "reset" else None,
            call_hook=hook if self.phase == "call" else None,
            close_hook=hook if self.phase == "close" else None,
        )


def hold_the_gil(env: FaultyEnv, action: Any) -> None:
    """From its second step on, the env runs a regex that backtracks for minutes in C code,
    holding the GIL all along (no other thread of its process runs meanwhile)."""
    if env.count >= 1:
        re.match(r"(a*)*b", "a" * 40)


_LEAKED: list[Any] = []


def leak_in_step(env: FaultyEnv, action: Any) -> None:
    """The victim keeps 10 MiB more (written, so resident) each step: a leaking env."""
    if env.seed_used == SEED + VICTIM:
        _LEAKED.append(np.ones(10 << 20, dtype=np.uint8))


LEAK = 4 << 20
"""Bytes every env keeps each step under :func:`leak_and_raise_on_2`."""


def leak_and_raise_on_2(env: FaultyEnv, action: Any) -> None:
    """Every env keeps :data:`LEAK` more bytes (written, so resident) each step, and action 2
    makes it raise: a leaking env that can also crash on cue."""
    _LEAKED.append(np.ones(LEAK, dtype=np.uint8))
    if int(action) == 2:
        raise ValueError("injected failure in step")
