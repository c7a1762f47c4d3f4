"""Rollouts on hosted VectorEnvs: a worker whose envs are one VectorEnv steps it straight into
the rollout's record (``HostedGroup.step_into``), not through the batch.

The oracle: a rollout gives exactly what the same pool gives stepped one step at a time with the
rollout's actions (observations, rewards, flags, infos, restarts), and leaves the pool where
those steps leave it, whether the VectorEnv steps plainly, ends episodes inside the rollout,
raises mid-rollout (rebuilt under ``on_error="restart"``, named under ``"raise"``) or gives
observations of another dtype; on one worker hosting one VectorEnv (the straight path), one
hosting two (the group's own step) and on worker processes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import envfleet
from envfleet.hosted.group import HostedGroup
from tests.test_hosted import assert_same, counting
from tests.test_hosted_workers import CastingVectorEnv

FACTORIES = {
    "plain": [functools.partial(counting, 3), functools.partial(counting, 2, length=3)],
    "raises": [functools.partial(counting, 3), functools.partial(counting, 2, fail_at=5)],
    "cast": [functools.partial(counting, 3), functools.partial(CastingVectorEnv, 2, np.int32)],
}
LAYOUTS = {
    "serial-one": ("serial", None),  # one worker, one VectorEnv: the straight path
    "serial-two": ("serial", None),  # one worker hosting both: the group's own step
    "process": ("process", 2),  # a VectorEnv a worker
}
ROLLOUTS, STEPS = 2, 6


def _factories(case: str, layout: str) -> list[Any]:
    fns = FACTORIES[case]
    return fns[1:] if layout == "serial-one" else fns


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(FACTORIES))
def test_a_rollout_is_the_same_steps_taken_one_at_a_time(
    case: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight: list[int] = []
    step_into = HostedGroup.step_into

    def counted(self: HostedGroup, *args: Any) -> Any:
        straight.append(1)
        return step_into(self, *args)

    monkeypatch.setattr(HostedGroup, "step_into", counted)
    backend, workers = LAYOUTS[layout]
    kwargs: dict[str, Any] = {"backend": backend, "seed": 3, "on_error": "restart"}
    if workers is not None:
        kwargs["num_workers"] = workers
    fns = _factories(case, layout)
    with (
        envfleet.make(vector_env_fns=fns, **kwargs) as pool,
        envfleet.make(vector_env_fns=fns, **kwargs) as stepped,
    ):
        pool.reset()
        obs, _ = stepped.reset()
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=0)
        for k in range(ROLLOUTS):
            out = pool.rollout(policy, STEPS)
            for t in range(STEPS):
                where = f"rollout {k}, step {t}"
                np.testing.assert_array_equal(out.observations[t], obs, err_msg=where)
                assert out.observations.dtype == obs.dtype
                obs, rewards, terminations, truncations, infos = stepped.step(out.actions[t])
                np.testing.assert_array_equal(out.rewards[t], rewards, err_msg=where)
                np.testing.assert_array_equal(out.terminations[t], terminations, err_msg=where)
                np.testing.assert_array_equal(out.truncations[t], truncations, err_msg=where)
                assert_same([infos], [out.infos[t]])
            np.testing.assert_array_equal(out.final_observations, obs)
        np.testing.assert_array_equal(pool.restarts, stepped.restarts)
        assert pool.restarts.any() == (case == "raises")
        after = np.ones(pool.num_envs, dtype=np.int64)  # the pool stands where the steps do
        assert_same(list(pool.step(after)), list(stepped.step(after)))
    assert bool(straight) == (layout == "serial-one")


def test_a_vector_env_that_raises_mid_rollout_under_raise_is_named() -> None:
    fns = FACTORIES["raises"]
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=2, seed=0) as pool:
        pool.reset()
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=0)
        with pytest.raises(envfleet.EnvRaisedError, match="broke on call 5") as info:
            pool.rollout(policy, STEPS)
        assert info.value.env_index == 3 and info.value.worker == 1


class Ones:
    """Action 1 for every env; its ``fail_at``-th call raises."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ZeroDivisionError("the policy broke")
        return np.ones(len(env_ids), dtype=np.int64)


@pytest.mark.parametrize("layout", ["serial-one", "process"])
def test_a_policy_that_raises_mid_rollout_leaves_the_pool_where_its_steps_did(
    layout: str,
) -> None:
    backend, workers = LAYOUTS[layout]
    kwargs: dict[str, Any] = {"backend": backend, "seed": 3}
    if workers is not None:
        kwargs["num_workers"] = workers
    fns = _factories("plain", layout)
    with (
        envfleet.make(vector_env_fns=fns, **kwargs) as pool,
        envfleet.make(vector_env_fns=fns, **kwargs) as stepped,
    ):
        pool.reset()
        stepped.reset()
        with pytest.raises(envfleet.EnvRaisedError, match="the policy broke"):
            pool.rollout(Ones(fail_at=5), STEPS)
        ones = np.ones(pool.num_envs, dtype=np.int64)
        for _ in range(4):
            obs = stepped.step(ones)[0]
        out = pool.rollout(Ones(fail_at=0), 2)  # from where the policy stopped
        np.testing.assert_array_equal(out.observations[0], obs)
        np.testing.assert_array_equal(out.observations[1], stepped.step(ones)[0])
        np.testing.assert_array_equal(out.final_observations, stepped.step(ones)[0])
        assert_same(list(pool.step(ones)), list(stepped.step(ones)))
