"""A Ray actor that replaces a lost one starts from its envs' rows as the pool holds them.

On one machine a worker's rows live in shared memory and outlive it: a restarted env's
truncation reports its latest observation (``final_obs`` too, with ``SAME_STEP``), and a rollout
part run again begins from it. An actor that takes Ray calls (as on another machine) keeps
arrays of its own; its replacement gets the rows the pool holds (observations, rewards, flags)
and writes them in before it serves, instead of starting from zeros. Both of the actors' paths
(``"socket"``: the pool's memory mapped; ``"calls"``: arrays of its own) are checked against
the process backend, values and dtypes, and a rollout part run again on a replacement against
:func:`tests.test_rollout_faults.assert_restarted_part`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
import envfleet.backends.ray.transport
from tests import faults
from tests.envs import FaultyEnv
from tests.faults import SEED
from tests.ray_helpers import local_ray_session, no_ray_leaks
from tests.test_equivalence import assert_same
from tests.test_rollout_faults import (
    MARK_AT,
    STEPS,
    WORKERS,
    N,
    Shift,
    assert_restarted_part,
    slow_envs,
    start_then_kill,
)

__all__ = ["local_ray_session", "no_ray_leaks"]  # fixtures, used by name

NUM_ENVS, NUM_WORKERS = 7, 3  # worker 1 holds envs 3 and 4; env 3 ends its process
VICTIM_ENVS = [3, 4]
PATHS = ["socket", "calls"]
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def same_machine(pool: envfleet.Pool) -> list[bool]:
    transport: envfleet.backends.ray.transport.RayTransport = pool._transport  # type: ignore[assignment]
    return transport.same_machine()


def run_through_a_lost_worker(mode: AutoresetMode, **kwargs: Any) -> list[Any]:
    """Reset, then steps: at :data:`faults.FAIL_AT_STEP` env 3 ends its worker's process
    mid-step; the worker is replaced and its envs report a truncated episode, then go on."""
    actions = np.ones(NUM_ENVS, dtype=np.int64)
    with envfleet.make(
        FaultyEnv,
        NUM_ENVS,
        num_workers=NUM_WORKERS,
        on_error="restart",
        autoreset_mode=mode,
        env_kwargs={"step_hook": faults.exit_in_step},
        **kwargs,
    ) as pool:
        results: list[Any] = [pool.reset(seed=faults.SEED)]
        results += [pool.step(actions) for _ in range(faults.FAIL_AT_STEP + 2)]
        results.append(pool.restarts.copy())
        if kwargs["backend"] == "ray":
            assert same_machine(pool) == [kwargs["ray_shared_memory"]] * NUM_WORKERS
    return results


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("path", PATHS)
def test_a_replaced_actors_envs_report_their_latest_rows_as_on_one_machine(
    ray_session: None, path: str, mode: AutoresetMode
) -> None:
    """The step that reports envs 3 and 4 truncated: their latest observations (the step
    before; ``final_obs`` with ``SAME_STEP``), as the process backend gives them, bit for bit;
    then the same steps."""
    want = run_through_a_lost_worker(mode, backend="process")
    got = run_through_a_lost_worker(mode, backend="ray", ray_shared_memory=path == "socket")
    lost = np.isin(np.arange(NUM_ENVS), VICTIM_ENVS)
    truncated = want[faults.FAIL_AT_STEP]
    np.testing.assert_array_equal(truncated[3], lost)  # the scenario, in the oracle
    latest = want[faults.FAIL_AT_STEP - 1][0][lost]
    assert (latest != 0).all()
    if mode is AutoresetMode.NEXT_STEP:
        np.testing.assert_array_equal(truncated[0][lost], latest)
    else:
        np.testing.assert_array_equal(np.stack(truncated[4]["final_obs"][lost]), latest)
    for k, (a, b) in enumerate(zip(want, got, strict=True)):
        assert_same(a, b, f"{path} {mode.name} result {k}")
    np.testing.assert_array_equal(got[-1], lost.astype(np.int64))


@pytest.mark.parametrize("path", PATHS)
def test_a_rollout_part_run_again_on_a_replaced_actor_begins_from_the_pools_rows(
    ray_session: None, tmp_path: Path, path: str
) -> None:
    """A worker's actor SIGKILLed mid-rollout under ``on_error="restart"``: its part runs again
    on a new actor whose first row is its envs' latest observation: where the killed actor's
    last step left it in the pool's memory (``"socket"``), or where the part began, the rows
    the pool holds (``"calls"``: the rows come back with the part only), never zeros."""
    marker = tmp_path / "marker"
    lost = np.isin(np.arange(N), [2, 3])
    with envfleet.make(
        slow_envs(marker, victim=2),
        backend="ray",
        num_workers=WORKERS,
        on_error="restart",
        seed=0,
        ray_shared_memory=path == "socket",
    ) as pool:
        assert same_machine(pool) == [path == "socket"] * WORKERS
        policy = Shift(1)
        start_then_kill(pool, policy, marker, None)
        before = pool.stats()
        counts = (SEED + np.arange(N)) * 100 + 2
        got = pool.rollout_wait()
        stood = range(MARK_AT - 1, STEPS) if path == "socket" else range(1)
        assert_restarted_part(got, lost, counts, stood=stood)
        np.testing.assert_array_equal(pool.restarts, lost.astype(np.int64))
        assert pool.stats().steps - before.steps == N * STEPS
        obs = pool.step(np.zeros(N, dtype=np.int64))[0]  # the pool goes on from there
        np.testing.assert_array_equal(obs[:, 0], got.final_observations[:, 0] + 1)
