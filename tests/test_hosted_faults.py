"""The failure matrix of hosted VectorEnvs: one that raises (every backend), whose worker dies
or that hangs (worker processes), under both ``on_error`` policies.

Two workers (one on the serial backend) each host a VectorEnv of 2 envs; the second's fails
once on its third step (a marker file: its rebuilt VectorEnv does not fail again). Under
``restart``, its block is rebuilt whole and both its envs are flagged and truncated on that step,
while the other block's values are those of the same VectorEnv alone, every step. Under
``raise``, the step raises the error that names the block's worker and envs, within a bound,
with the other block's results on it (and none of the failed block's: its envs failed with it),
and the pool is broken after. The conftest's autouse fixture checks that no process and no
shared memory remain.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import pytest

import envfleet
from tests import timing
from tests.test_hosted import CountingVectorEnv

SIZE = 2  # envs per VectorEnv: the healthy block is envs 0-1, the faulty one envs 2-3
FAULT_CALL = 3  # the faulty VectorEnv's step call that fails (the pool's third step)
STEPS = 6
SEED = 4


class FaultyVectorEnv(CountingVectorEnv):
    """:class:`~tests.test_hosted.CountingVectorEnv` whose step ``FAULT_CALL`` raises, exits its
    process or hangs (``fault``), once per run (``marker``: a file written when it does)."""

    def __init__(self, num_envs: int, fault: str, marker: str) -> None:
        super().__init__(num_envs)
        self.fault, self.marker = fault, marker

    def step(self, actions: Any) -> Any:
        if self.calls + 1 == FAULT_CALL and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.fault == "raise":
                raise RuntimeError("the batched simulator broke")
            if self.fault == "exit":
                os._exit(3)
            time.sleep(3600)  # hang: killed past step_timeout
        return super().step(actions)


def healthy(num_envs: int) -> CountingVectorEnv:
    return CountingVectorEnv(num_envs)


def faulty(num_envs: int, fault: str, marker: str) -> FaultyVectorEnv:
    return FaultyVectorEnv(num_envs, fault, marker)


ERRORS: dict[str, type[envfleet.EnvError]] = {
    "raise": envfleet.EnvRaisedError,
    "exit": envfleet.WorkerDiedError,
    "hang": envfleet.EnvTimeoutError,
}

CELLS = [
    ("raise", "serial"),
    ("raise", "thread"),
    ("raise", "process"),
    ("exit", "process"),
    ("hang", "process"),
]
"""Each fault on the backends it applies to (a thread cannot be killed, a process exit ends the
caller's own on the serial backend)."""

ACTIONS = np.random.default_rng(3).integers(0, 3, size=(STEPS, 2 * SIZE))


def _pool(fault: str, where: str, on_error: str, marker: str, **more: Any) -> envfleet.Pool:
    fns = [functools.partial(healthy, SIZE), functools.partial(faulty, SIZE, fault, marker)]
    killable = where in ("process", "ray")
    return envfleet.make(
        vector_env_fns=fns,
        backend=where,
        seed=SEED,
        on_error=on_error,
        # A loaded machine's step may take seconds: the bound widens with what a pool costs now
        # (only worker processes can be killed past it).
        step_timeout=timing.bound(1.0, pools=2) if killable else None,
        **more,
    )


def _alone() -> list[tuple[Any, ...]]:
    """The healthy block's VectorEnv alone, seeded as the pool seeds it, with its actions."""
    venv = CountingVectorEnv(SIZE)
    obs, _ = venv.reset(seed=np.arange(SEED, SEED + SIZE))
    return [(obs, None), *(venv.step(a[:SIZE]) for a in ACTIONS)]


def check_restarted(pool: envfleet.Pool, marker: str) -> None:
    """Under ``restart``: the healthy block is its VectorEnv alone every step; the failed block
    restarted once, on the step that failed (flagged, truncated), and nothing else ever."""
    want = _alone()
    obs, _ = pool.reset()
    np.testing.assert_array_equal(obs[:SIZE], want[0][0])
    flagged: list[list[int]] = []
    for step, actions in enumerate(ACTIONS, start=1):
        obs, rewards, terminations, truncations, infos = pool.step(actions)
        got = np.flatnonzero(infos.get("envfleet/restarted", np.zeros(2 * SIZE, bool)))
        flagged.append(got.tolist())
        if got.size:
            assert truncations[got].all(), (step, truncations)
        w_obs, w_rewards, w_terminations, w_truncations, _ = want[step]
        np.testing.assert_array_equal(obs[:SIZE], w_obs, err_msg=f"step {step}")
        np.testing.assert_array_equal(rewards[:SIZE], w_rewards, err_msg=f"step {step}")
        np.testing.assert_array_equal(truncations[:SIZE], w_truncations)
        np.testing.assert_array_equal(terminations[:SIZE], w_terminations)
    assert os.path.exists(marker)
    assert flagged == [[2, 3] if step == FAULT_CALL else [] for step in range(1, STEPS + 1)]
    assert pool.restarts.tolist() == [0, 0, 1, 1]


def check_raised(pool: envfleet.Pool, fault: str, worker: int) -> None:
    """Under ``raise``: the step that fails raises the error naming ``worker`` and the block,
    within a bound, with the healthy block's results only on it; the pool is broken after."""
    pool.reset()
    for actions in ACTIONS[: FAULT_CALL - 1]:
        pool.step(actions)
    started = time.monotonic()
    with pytest.raises(ERRORS[fault]) as info:
        pool.step(ACTIONS[FAULT_CALL - 1])
    assert time.monotonic() - started < timing.bound(15.0, pools=4)
    error = info.value
    assert error.phase is envfleet.Phase.STEP and error.worker == worker
    if fault == "raise":
        assert error.env_index == SIZE  # the block's first env
        assert "broke" in str(error.__cause__)
    else:
        assert isinstance(error, envfleet.WorkerDiedError)
        assert tuple(error.env_ids) == (2, 3) and f"worker {worker}" in str(error)
    # The healthy block finished that step: its results ride on the error, and no other's.
    assert error.completed is not None
    assert set(error.completed[4]["env_id"].tolist()) == {0, 1}
    with pytest.raises(envfleet.BrokenPoolError):
        pool.step(ACTIONS[FAULT_CALL])


@pytest.mark.parametrize(("fault", "where"), CELLS)
def test_a_failed_hosted_vector_env_is_rebuilt_whole_and_the_other_block_goes_on(
    fault: str, where: str, tmp_path: Any
) -> None:
    marker = str(tmp_path / "failed")
    pool = _pool(fault, where, "restart", marker)
    try:
        check_restarted(pool, marker)
    finally:
        pool.close()
        pool.close()


@pytest.mark.parametrize(("fault", "where"), CELLS)
def test_a_failed_hosted_vector_env_under_raise_names_its_block_within_a_bound(
    fault: str, where: str, tmp_path: Any
) -> None:
    pool = _pool(fault, where, "raise", str(tmp_path / "failed"))
    try:
        check_raised(pool, fault, 0 if where == "serial" else 1)
    finally:
        pool.close()
        pool.close()


class FailingReset(CountingVectorEnv):
    """A VectorEnv whose reset raises (every time)."""

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> Any:
        raise RuntimeError("the batched simulator would not reset")


def failing_reset(num_envs: int) -> FailingReset:
    return FailingReset(num_envs)


def test_a_hosted_vector_env_whose_reset_raises_fails_its_whole_block() -> None:
    """Each env of the block failed: none of them counts as reset (their rows are stale)."""
    fns = [functools.partial(healthy, SIZE), functools.partial(failing_reset, SIZE)]
    with envfleet.make(vector_env_fns=fns, backend="process", seed=SEED) as pool:
        with pytest.raises(envfleet.EnvRaisedError, match="would not reset") as info:
            pool.reset()
        error = info.value
        assert error.phase is envfleet.Phase.RESET and error.env_index == SIZE
        assert error.worker == 1
        assert error.completed is not None
        assert set(error.completed[-1]["env_id"].tolist()) == {0, 1}
