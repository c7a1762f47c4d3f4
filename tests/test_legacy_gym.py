"""Legacy gym support: old-API envs, real ``gym`` envs through Shimmy, and ids only gym knows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet.legacy import LegacyEnv, as_gymnasium, convert_space, is_legacy_env
from envfleet.spec import EnvSpec
from tests import legacy_envs
from tests.legacy_envs import (
    GYM_INSTALLED,
    LEGACY_GYM_ID,
    LEGACY_GYM_MAX_STEPS,
    MAX_STEPS,
    NewApiDuckEnv,
    OldApiCounterEnv,
    start_of,
)

SHIMMY_INSTALLED = GYM_INSTALLED and importlib.util.find_spec("shimmy") is not None
needs_gym = pytest.mark.skipif(not SHIMMY_INSTALLED, reason="needs the gym and shimmy packages")

COUNTER_ENVS: list[Any] = [
    OldApiCounterEnv,
    NewApiDuckEnv,
    pytest.param(getattr(legacy_envs, "GymCounterEnv", None), marks=needs_gym, id="GymCounterEnv"),
]
SEED = 10
ACTIONS = np.array([1, 0, 1, 0])  # envs 0 and 2 terminate at step 3; envs 1 and 3 truncate at 5


def _offsets(seed: int, draws: int) -> list[int]:
    rng = np.random.RandomState(seed)
    return [int(rng.randint(0, 100)) for _ in range(draws)]


def _run(pool: envfleet.Pool, steps: int) -> tuple[np.ndarray, ...]:
    obs0, _ = pool.reset()
    history: list[Any] = [[obs0], [], [], [], []]
    for _ in range(steps):
        obs, reward, terminated, truncated, infos = pool.step(ACTIONS)
        assert "TimeLimit.truncated" not in infos  # the converter consumed it
        for column, value in zip(
            history, (obs, reward, terminated, truncated, infos["t"]), strict=True
        ):
            column.append(value)
    return tuple(np.array(column) for column in history)


def test_legacy_envs_are_detected_without_being_gymnasium_envs() -> None:
    assert is_legacy_env(OldApiCounterEnv())
    assert is_legacy_env(NewApiDuckEnv())
    assert not is_legacy_env(OldApiCounterEnv)  # a class is a factory, not an env
    assert not is_legacy_env(gymnasium.make("CartPole-v1"))
    assert not is_legacy_env(lambda: None)


@pytest.mark.parametrize("env_cls", COUNTER_ENVS)
def test_old_api_trajectories_are_converted(env_cls: Any, backend: str) -> None:
    with envfleet.make(env_cls, 4, backend=backend, seed=SEED) as pool:
        assert pool.single_observation_space == spaces.Box(0.0, 1000.0, (2,), np.float32)
        assert pool.single_action_space == spaces.Discrete(2)
        obs, rewards, terminated, truncated, t = _run(pool, steps=7)
        # env.seed(seed + i) before the first reset, as gym 0.21 seeded.
        assert pool.get_attr("seeds") == tuple([SEED + i] for i in range(4))

    first, second = zip(*(_offsets(SEED + i, 2) for i in range(4)), strict=True)
    np.testing.assert_array_equal(obs[0], [[s, 0] for s in first])
    # Counting envs: +1 per step, terminated (not truncated) at step 3, reset on step 4
    # (NEXT_STEP), counting again from the next seeded offset, terminated at step 7.
    for i in (0, 2):
        assert terminated[:, i].tolist() == [False, False, True, False, False, False, True]
        assert not truncated[:, i].any()
        assert rewards[:, i].tolist() == [1, 1, 1, 0, 1, 1, 1]
        np.testing.assert_array_equal(obs[1:4, i], [[first[i] + k, k] for k in (1, 2, 3)])
        np.testing.assert_array_equal(obs[4, i], [second[i], 0])
        np.testing.assert_array_equal(obs[7, i], [second[i] + 3, 3])
    # Idle envs: done with TimeLimit.truncated at step 5 becomes truncated, not terminated.
    for i in (1, 3):
        assert truncated[:, i].tolist() == [False, False, False, False, True, False, False]
        assert not terminated[:, i].any()
        assert not rewards[:, i].any()
        np.testing.assert_array_equal(obs[5, i], [first[i], 5])
        np.testing.assert_array_equal(obs[6, i], [second[i], 0])
    assert t[:, 0].tolist()[:3] == [1, 2, 3]


@pytest.mark.parametrize("env_cls", COUNTER_ENVS)
def test_same_step_autoreset_reports_the_final_observation(env_cls: Any) -> None:
    mode = AutoresetMode.SAME_STEP
    with envfleet.make(env_cls, 2, backend="serial", seed=SEED, autoreset_mode=mode) as pool:
        pool.reset()
        for _ in range(3):
            obs, _, terminated, truncated, infos = pool.step(np.array([1, 0]))
    first, second = _offsets(SEED, 2)
    assert terminated.tolist() == [True, False] and not truncated.any()
    assert infos["_final_obs"].tolist() == [True, False]
    np.testing.assert_array_equal(infos["final_obs"][0], [first + 3, 3])
    assert infos["final_info"]["t"][0] == 3
    np.testing.assert_array_equal(obs[0], [second, 0])


def test_the_conversion_path_follows_the_reset_signature() -> None:
    old = EnvSpec(OldApiCounterEnv).build()
    new = EnvSpec(NewApiDuckEnv).build()
    assert isinstance(old, LegacyEnv) and not old._takes_seed
    assert isinstance(new, LegacyEnv) and new._takes_seed
    obs, info = new.reset(seed=4, options={"level": 2})
    assert info == {"options": {"level": 2}} and obs[0] == start_of(4)
    assert old.render_mode == "rgb_array"
    old.reset(seed=1)
    old.step(0)
    assert old.render().tolist() == np.full((2, 2, 3), 1).tolist()


@needs_gym
def test_gym_envs_go_through_shimmy() -> None:
    import gym
    from shimmy import GymV21CompatibilityV0, GymV26CompatibilityV0

    v21 = EnvSpec(legacy_envs.GymCounterEnv).build()
    v26 = EnvSpec(lambda: gym.make("CartPole-v1")).build()
    assert isinstance(v21, GymV21CompatibilityV0)
    assert isinstance(v26, GymV26CompatibilityV0)
    assert v21.observation_space == spaces.Box(0.0, 1000.0, (2,), np.float32)
    assert isinstance(v26.observation_space, spaces.Box)  # gym's CartPole box (finite bounds)
    assert v26.observation_space.shape == (4,) and v26.action_space == spaces.Discrete(2)
    v26.reset(seed=0)
    v26.step(0)  # gym's PassiveEnvChecker (np.bool8, gone in NumPy 2) was taken out


def _gymnasium_reference(num_envs: int, seed: int, actions: np.ndarray, max_steps: int) -> Any:
    reference = gymnasium.make_vec(
        "CartPole-v1",
        num_envs,
        vectorization_mode="sync",
        max_episode_steps=max_steps,
    )
    try:
        steps = [reference.reset(seed=seed)[0]]
        for action in actions:
            obs, reward, terminated, truncated, _ = reference.step(action)
            steps.append((obs, reward, terminated, truncated))
        return steps
    finally:
        reference.close()


def _pool_steps(pool: envfleet.Pool, actions: np.ndarray) -> list[Any]:
    steps: list[Any] = [pool.reset()[0]]
    for action in actions:
        obs, reward, terminated, truncated, _ = pool.step(action)
        steps.append((obs, reward, terminated, truncated))
    return steps


def _assert_same_steps(got: list[Any], expected: list[Any]) -> None:
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    for (obs, reward, term, trunc), (e_obs, e_reward, e_term, e_trunc) in zip(
        got[1:], expected[1:], strict=True
    ):
        np.testing.assert_allclose(obs, e_obs, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(reward, e_reward)
        np.testing.assert_array_equal(term, e_term)
        np.testing.assert_array_equal(trunc, e_trunc)


@needs_gym
def test_a_gym_factory_matches_gymnasiums_cartpole(backend: str) -> None:
    import gym

    actions = np.random.default_rng(0).integers(0, 2, size=(25, 3))

    def factory() -> Any:
        return gym.make("CartPole-v1", max_episode_steps=10)

    with envfleet.make(factory, 3, backend=backend, seed=5) as pool:
        got = _pool_steps(pool, actions)
    expected = _gymnasium_reference(3, 5, actions, max_steps=10)
    _assert_same_steps(got, expected)
    assert np.array([s[3] for s in got[1:]]).any()  # the time limit was reached


@needs_gym
def test_an_id_only_gym_knows_falls_back_to_gym(backend: str) -> None:
    env_id = f"tests.legacy_envs:{LEGACY_GYM_ID}"
    assert LEGACY_GYM_ID not in gymnasium.registry
    spec = EnvSpec.from_user(env_id)
    assert spec.legacy_gym
    actions = np.tile([1, 0], (LEGACY_GYM_MAX_STEPS + 3, 1))
    with envfleet.make(env_id, 2, backend=backend, seed=1) as pool:
        got = _pool_steps(pool, actions)
    expected = _gymnasium_reference(2, 1, actions, max_steps=LEGACY_GYM_MAX_STEPS)
    _assert_same_steps(got, expected)
    truncations = np.array([s[3] for s in got[1:]])
    assert truncations[LEGACY_GYM_MAX_STEPS - 1].all()


def test_gymnasium_registry_comes_first_for_old_atari_ids() -> None:
    spec = EnvSpec.from_user("Pong-v0")
    assert not spec.legacy_gym  # ale-py registers the old Atari ids with Gymnasium
    with envfleet.make("Pong-v0", 2, backend="serial", seed=0) as pool:
        obs, _ = pool.reset()
        obs, _, terminated, truncated, _ = pool.step(np.array([0, 1]))
    assert obs.shape == (2, 210, 160, 3) and obs.dtype == np.uint8
    assert pool.single_action_space == spaces.Discrete(6)
    assert not terminated.any() and not truncated.any()


def test_unknown_ids_still_get_gymnasiums_suggestions() -> None:
    with pytest.raises(ValueError, match="unknown environment id 'CartPol-v1'"):
        EnvSpec.from_user("CartPol-v1")


def test_a_legacy_env_instance_is_refused_like_a_gymnasium_one() -> None:
    with pytest.raises(TypeError, match="not an instance"):
        EnvSpec.from_user(OldApiCounterEnv())


def test_a_factory_returning_something_else_is_refused() -> None:
    with pytest.raises(TypeError, match=r"expected a gymnasium\.Env"):
        EnvSpec(lambda: object()).build()
    with pytest.raises(TypeError, match=r"neither a gymnasium\.Env nor a legacy gym env"):
        as_gymnasium(42)


def test_five_value_step_of_a_legacy_env_passes_through() -> None:
    env = LegacyEnv(NewApiDuckEnv())
    env.reset(seed=0)
    for _ in range(MAX_STEPS):
        _, _, terminated, truncated, info = env.step(0)
    assert (terminated, truncated) == (False, True) and info == {"t": MAX_STEPS}


def test_unconvertible_spaces_are_named() -> None:
    class Odd:
        pass

    with pytest.raises(TypeError, match="cannot convert the legacy space"):
        convert_space(Odd())


@needs_gym
def test_gym_spaces_convert_to_equal_gymnasium_spaces() -> None:
    import gym

    pairs = [
        (gym.spaces.Discrete(4, start=1), spaces.Discrete(4, start=1)),
        (gym.spaces.Box(-1, 1, (2, 3), np.float32), spaces.Box(-1, 1, (2, 3), np.float32)),
        (gym.spaces.MultiDiscrete([2, 3]), spaces.MultiDiscrete([2, 3])),
        (gym.spaces.MultiBinary(5), spaces.MultiBinary(5)),
        (
            gym.spaces.Dict({"a": gym.spaces.Tuple((gym.spaces.Discrete(2),))}),
            spaces.Dict({"a": spaces.Tuple((spaces.Discrete(2),))}),
        ),
    ]
    for legacy, expected in pairs:
        assert convert_space(legacy) == expected


def test_gymnasium_users_never_import_gym() -> None:
    code = """
import sys
import numpy as np
from gymnasium import spaces
from envfleet.spec import EnvSpec

class Duck:
    observation_space = spaces.Discrete(3)
    action_space = spaces.Discrete(2)
    def reset(self):
        return 0
    def step(self, action):
        return 1, 0.0, True, {}

EnvSpec.from_user("CartPole-v1").build().reset(seed=0)
env = EnvSpec.from_user(Duck).build()
env.reset(seed=0)
assert env.step(0)[2:4] == (True, False)
assert "gym" not in sys.modules and "shimmy" not in sys.modules, sorted(sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
