"""The deliberate segfault of the failure matrix leaves no "Fatal Python error" dump in the test
log (which reads as a real crash), while a real crash elsewhere still dumps."""

from __future__ import annotations

import faulthandler
import functools

import pytest

import envfleet
from tests import matrix_hooks as hooks
from tests.envs import FaultyEnv


def test_the_deliberate_segfault_prints_no_dump(capfd: pytest.CaptureFixture[str]) -> None:
    faulthandler.enable()  # as pytest does; forked workers inherit it
    pool = envfleet.make(
        functools.partial(FaultyEnv, step_hook=hooks.segfault_in_step),
        hooks.NUM_ENVS,
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        context="fork",
    )
    with pool, pytest.raises(envfleet.WorkerDiedError, match="SIGSEGV"):
        pool.reset()
        for _ in range(hooks.FAULT_STEP + 1):
            pool.step([0] * hooks.NUM_ENVS)
    assert faulthandler.is_enabled()  # this process keeps it: real crashes still dump
    assert "Fatal Python error" not in capfd.readouterr().err
