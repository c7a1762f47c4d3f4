"""The Stable-Baselines3 adapter: SB3's VecEnv checks that apply, and PPO learning CartPole."""

from __future__ import annotations

import collections
import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers import RecordEpisodeStatistics, TimeLimit

pytest.importorskip("stable_baselines3")

from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import (
    SubprocVecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
)

import envfleet
from envfleet.adapters.sb3 import VecEnv, make_sb3, to_sb3_infos, unbatch_infos
from tests.envs import IN_PARENT, InheritingEnv, StepEnv

N_ENVS = 3
POOLS = [("serial", None), ("process", 2)]
POOL_IDS = ["serial", "process-w2"]


class CustomEnv(gymnasium.Env[Any, Any]):
    """SB3's test env: random observations of ``space``, 4-step episodes, a custom method."""

    def __init__(self, space: spaces.Space[Any], render_mode: str | None = "rgb_array") -> None:
        self.action_space = space
        self.observation_space = space
        self.current_step = 0
        self.ep_length = 4
        self.render_mode = render_mode
        self.last_options: dict[str, Any] | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        self.last_options = options
        self.current_step = 0
        return self.observation_space.sample(), {"reset": True}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.current_step += 1
        done = self.current_step >= self.ep_length
        return self.observation_space.sample(), float(self.np_random.random()), done, False, {}

    def render(self) -> np.ndarray | None:
        if self.render_mode == "rgb_array":
            return np.full((4, 4, 3), self.current_step, dtype=np.uint8)
        return None

    @staticmethod
    def custom_method(dim_0: int = 1, dim_1: int = 1) -> np.ndarray:
        return np.ones((dim_0, dim_1))


def _step_envs(config: tuple[str, int | None], lengths: list[int]) -> VecEnv:
    """StepEnvs with one episode length each (set per env, as SB3's test builds them)."""
    venv = _venv(functools.partial(StepEnv, 1), config, n=len(lengths))
    for i, length in enumerate(lengths):
        venv.set_attr("max_steps", length, indices=[i])
    return venv


def _box() -> spaces.Box:
    return spaces.Box(low=np.zeros(2, np.float32), high=np.ones(2, np.float32))


def _venv(factory: Any, config: tuple[str, int | None], n: int = N_ENVS, **kwargs: Any) -> VecEnv:
    backend, workers = config
    return make_sb3(factory, n, backend=backend, num_workers=workers, **kwargs)


WRAPPERS = [None, VecNormalize, functools.partial(VecFrameStack, n_stack=2)]
WRAPPER_IDS = ["plain", "VecNormalize", "VecFrameStack"]


@pytest.mark.parametrize("config", POOLS, ids=POOL_IDS)
@pytest.mark.parametrize("wrapper", WRAPPERS, ids=WRAPPER_IDS)
def test_custom_calls(config: tuple[str, int | None], wrapper: Any) -> None:
    venv = _venv(functools.partial(CustomEnv, _box()), config)
    vec_env: Any = venv if wrapper is None else wrapper(venv)
    try:
        assert vec_env.seed(0) == [0, 1, 2]
        vec_env.reset()
        explicit = vec_env.render(mode="rgb_array")
        implicit = vec_env.render()
        assert implicit.shape == (8, 8, 3) and np.array_equal(implicit, explicit)
        with pytest.warns(UserWarning):
            vec_env.render(mode="something_else")

        results = vec_env.env_method("custom_method", 1, indices=None, dim_1=2)
        assert len(results) == N_ENVS and all((r == np.ones((1, 2))).all() for r in results)
        for i in range(N_ENVS):
            assert vec_env.set_attr("current_step", i, indices=i) is None
        assert vec_env.get_attr("current_step") == [0, 1, 2]

        subset = vec_env.env_method("custom_method", 1, indices=[0, 2], dim_1=3)
        assert len(subset) == 2 and all((r == np.ones((1, 3))).all() for r in subset)

        vec_env.set_attr("current_step", 42, indices=None)
        assert vec_env.get_attr("current_step") == [42] * N_ENVS

        vec_env.reset()
        vec_env.set_attr("current_step", 12, indices=[0, 1])
        assert vec_env.get_attr("current_step") == [12, 12, 0]
        assert vec_env.get_attr("current_step", indices=[0, 2]) == [12, 0]

        vec_env.reset()
        vec_env.set_attr("current_step", 12, indices=[0, -1])
        assert vec_env.get_attr("current_step") == [12, 0, 12]
        assert vec_env.get_attr("current_step", indices=[-1]) == [12]

        assert vec_env.has_attr("ep_length") and not vec_env.has_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            vec_env.get_attr("no_such_attribute")
        # A method comes back uncalled, as SB3's own VecEnvs return it.
        assert callable(vec_env.get_attr("custom_method", indices=[0])[0])
    finally:
        vec_env.close()


@pytest.mark.parametrize("config", POOLS, ids=POOL_IDS)
@pytest.mark.parametrize("wrapper", WRAPPERS, ids=WRAPPER_IDS)
def test_terminal_observation(config: tuple[str, int | None], wrapper: Any) -> None:
    lengths = [5, 6, 7]
    venv = _step_envs(config, lengths)
    vec_env: Any = venv if wrapper is None else wrapper(venv)
    try:
        zero = np.zeros(N_ENVS, dtype=np.int64)
        prev_obs_b = vec_env.reset()
        for step_num in range(1, max(lengths) + 1):
            obs_b, _, done_b, info_b = vec_env.step(zero)
            assert len(obs_b) == len(done_b) == len(info_b) == N_ENVS
            for i, (prev_obs, obs, done, info) in enumerate(
                zip(prev_obs_b, obs_b, done_b, info_b, strict=True)
            ):
                assert done == (step_num == lengths[i])
                assert info["TimeLimit.truncated"] == (done and lengths[i] % 2 == 0)
                if not done:
                    assert "terminal_observation" not in info
                    continue
                terminal_obs = info["terminal_observation"]
                assert np.all(prev_obs < terminal_obs) and np.all(obs < prev_obs)
                if wrapper is None:
                    assert np.all(prev_obs + 1 == terminal_obs) and np.all(obs == 0)
            prev_obs_b = obs_b
    finally:
        vec_env.close()


SPACES = collections.OrderedDict(
    [
        ("discrete", spaces.Discrete(2)),
        ("multidiscrete", spaces.MultiDiscrete([2, 3])),
        ("multibinary", spaces.MultiBinary(3)),
        ("continuous", _box()),
    ]
)


def _check_spaces(space: spaces.Space[Any], obs_assert: Any) -> None:
    venv = make_sb3(functools.partial(CustomEnv, space), N_ENVS, backend="process", num_workers=2)
    try:
        obs_assert(venv.reset())
        dones = np.zeros(N_ENVS, dtype=bool)
        steps = 0
        while not dones.any():
            actions: Any = [venv.action_space.sample() for _ in range(N_ENVS)]
            if not isinstance(space, spaces.Dict | spaces.Tuple):
                actions = np.array(actions)
            venv.step_async(actions)  # one action per env, as SB3's tests pass them
            obs, _, dones, infos = venv.step_wait()
            obs_assert(obs)
            steps += 1
        assert steps == 4
        for info in infos:
            obs_assert_one = info["terminal_observation"]
            assert venv.observation_space.contains(obs_assert_one)
    finally:
        venv.close()


def _check_obs(obs: np.ndarray, space: spaces.Space[Any]) -> None:
    assert obs.shape[0] == N_ENVS
    for value in obs:
        assert space.contains(value)


@pytest.mark.parametrize("space", SPACES.values(), ids=SPACES.keys())
def test_single_spaces(space: spaces.Space[Any]) -> None:
    _check_spaces(space, lambda obs: _check_obs(obs, space))


def test_dict_spaces() -> None:
    space = spaces.Dict(SPACES)

    def obs_assert(obs: Any) -> None:
        assert isinstance(obs, dict) and list(obs) == list(space.spaces)
        for key, values in obs.items():
            _check_obs(values, space.spaces[key])

    _check_spaces(space, obs_assert)


def test_tuple_spaces() -> None:
    space = spaces.Tuple(tuple(SPACES.values()))

    def obs_assert(obs: Any) -> None:
        assert isinstance(obs, tuple) and len(obs) == len(space.spaces)
        for values, inner in zip(obs, space.spaces, strict=True):
            _check_obs(values, inner)

    _check_spaces(space, obs_assert)


def _monitored(env: gymnasium.Env[Any, Any]) -> gymnasium.Env[Any, Any]:
    return Monitor(env)


def test_env_is_wrapped_is_exact_through_make_sb3() -> None:
    class SubMonitor(Monitor):  # type: ignore[misc]
        pass

    with_monitor = make_sb3(
        functools.partial(CustomEnv, _box()), 2, backend="serial", wrappers=[SubMonitor]
    )
    without = make_sb3(functools.partial(CustomEnv, _box()), 2, backend="serial")
    try:
        assert with_monitor.env_is_wrapped(Monitor) == [True, True]  # isinstance, not names
        assert with_monitor.env_is_wrapped(TimeLimit, indices=[1]) == [False]
        assert without.env_is_wrapped(Monitor) == [False, False]
        assert VecMonitor(without).venv is without  # VecMonitor asks env_is_wrapped(Monitor)
        frames = VecFrameStack(with_monitor, n_stack=2)
        assert frames.env_is_wrapped(Monitor) == [True, True]
    finally:
        with_monitor.close()
        without.close()


def test_a_pool_made_without_make_sb3_works_with_limits(backend: str) -> None:
    pool = envfleet.make(
        "CartPole-v1", 4, backend=backend, seed=0, autoreset_mode=AutoresetMode.SAME_STEP
    )
    venv = VecEnv(pool)
    try:
        obs = venv.reset()
        assert obs.shape == (4, 4)
        assert venv.env_is_wrapped(TimeLimit) == [True] * 4  # by class name here
        assert venv.env_is_wrapped(Monitor) == [False] * 4
        assert venv.get_attr("gravity", indices=[2]) == [9.8]
        venv.set_attr("gravity", 3.0)
        assert venv.env_method("get_wrapper_attr", "gravity") == [3.0] * 4
        with pytest.raises(NotImplementedError, match="make_sb3"):
            venv.set_attr("gravity", 1.0, indices=[0])
        with pytest.raises(NotImplementedError, match="make_sb3"):
            venv.env_method("reset", indices=[0])
    finally:
        venv.close()
    assert pool.closed


def test_only_same_step_sync_pools_are_accepted() -> None:
    with (
        envfleet.make("CartPole-v1", 2, backend="serial") as next_step,
        pytest.raises(ValueError, match="SAME_STEP"),
    ):
        VecEnv(next_step)
    with (
        envfleet.make(
            "CartPole-v1",
            2,
            backend="serial",
            batch_size=1,
            autoreset_mode=AutoresetMode.SAME_STEP,
        ) as async_pool,
        pytest.raises(ValueError, match="batch_size"),
    ):
        VecEnv(async_pool)
    with pytest.raises(ValueError, match="SAME_STEP"):
        make_sb3("CartPole-v1", 2, backend="serial", autoreset_mode=AutoresetMode.NEXT_STEP)


@pytest.mark.parametrize("config", POOLS, ids=POOL_IDS)
def test_seeding(config: tuple[str, int | None]) -> None:
    venv = _venv(functools.partial(CustomEnv, _box()), config)
    try:
        venv.seed(3)
        obs = venv.reset()
        venv.seed(3)
        assert np.array_equal(venv.reset(), obs)
        venv.seed()  # a random seed, different per env
        obs = venv.reset()
        _, rewards, _, _ = venv.step(np.array([venv.action_space.sample() for _ in range(3)]))
        assert not np.allclose(obs[0], obs[1]) and not np.allclose(obs[1], obs[2])
        assert not np.isclose(rewards[0], rewards[1]) and not np.isclose(rewards[1], rewards[2])
        assert venv.reset_infos == [{"reset": True}] * N_ENVS
    finally:
        venv.close()


def test_reset_options_reach_the_envs() -> None:
    venv = _venv(functools.partial(CustomEnv, _box()), ("process", 2))
    try:
        venv.set_options({"level": 1})
        venv.reset()
        assert venv.get_attr("last_options") == [{"level": 1}] * N_ENVS
        venv.reset()  # options are used once
        assert venv.get_attr("last_options") == [None] * N_ENVS
        venv.set_options([{"level": 1}, {}, {"level": 2}])
        venv.seed(7)
        obs = venv.reset()
        first, empty, last = venv.get_attr("last_options")
        assert (first, last) == ({"level": 1}, {"level": 2}) and not empty
        venv.seed(7)
        assert np.array_equal(venv.reset(), obs)  # each group kept its seeds
    finally:
        venv.close()


def test_reset_cancels_a_step_in_flight() -> None:
    venv = _step_envs(("process", 2), [5, 5, 5])
    try:
        venv.reset()
        venv.step_async(np.zeros(N_ENVS, dtype=np.int64))
        assert venv.reset().tolist() == [[0]] * N_ENVS
        obs, _, _, _ = venv.step(np.zeros(N_ENVS, dtype=np.int64))
        assert obs.tolist() == [[1]] * N_ENVS
    finally:
        venv.close()


def test_get_images() -> None:
    venv = _venv(functools.partial(CustomEnv, _box()), ("serial", None))
    quiet = _venv(functools.partial(CustomEnv, _box(), render_mode=None), ("serial", None))
    try:
        venv.reset()
        venv.step(np.zeros((N_ENVS, 2)))
        images = venv.get_images()
        assert len(images) == N_ENVS and all(np.all(image == 1) for image in images)  # type: ignore[arg-type]
        with pytest.warns(UserWarning, match="rgb_array"):
            assert quiet.get_images() == [None] * N_ENVS
    finally:
        venv.close()
        quiet.close()


def test_episode_statistics_reach_sb3() -> None:
    venv = make_sb3(
        functools.partial(StepEnv, 5), 2, backend="serial", wrappers=[RecordEpisodeStatistics]
    )
    try:
        venv.set_attr("max_steps", 9, indices=[1])
        venv.reset()
        for _ in range(5):
            _, _, dones, infos = venv.step(np.zeros(2, dtype=np.int64))
        assert dones.tolist() == [True, False]
        assert infos[0]["episode"]["l"] == 5 and infos[0]["episode"]["r"] == 0.0
        assert "episode" not in infos[1]
    finally:
        venv.close()


def test_infos_conversion() -> None:
    infos = {
        "t": np.array([1, 0, 3]),
        "_t": np.array([True, False, True]),
        "final_obs": np.array([None, np.array([9.0]), None], dtype=object),
        "_final_obs": np.array([False, True, False]),
        "final_info": {
            "t": np.array([0, 4, 0]),
            "_t": np.array([False, True, False]),
            "episode": {
                "r": np.array([0.0, 2.5, 0.0]),
                "_r": np.array([False, True, False]),
            },
            "_episode": np.array([False, True, False]),
        },
        "_final_info": np.array([False, True, False]),
        "seed_info": np.array([0, 17, 0]),
        "_seed_info": np.array([False, True, False]),
    }
    assert unbatch_infos(infos, 3)[0] == {"t": 1}
    terminations = np.array([False, False, False])
    truncations = np.array([False, True, False])
    step_infos, reset_infos = to_sb3_infos(infos, terminations, truncations)
    assert step_infos[0] == {"t": 1, "TimeLimit.truncated": False}
    assert step_infos[2] == {"t": 3, "TimeLimit.truncated": False}
    ended = step_infos[1]
    assert ended["t"] == 4 and ended["episode"] == {"r": 2.5}
    assert ended["TimeLimit.truncated"] is True
    assert ended["terminal_observation"].tolist() == [9.0]
    assert reset_infos == {1: {"seed_info": 17}}
    assert type(ended["t"]) is int  # numpy scalars become Python numbers


class TypedInfoEnv(StepEnv):
    """StepEnv whose step infos hold Python and numpy scalars of several types."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, _ = super().step(action)
        k = self.current_step
        info = {
            "f32": np.float32(k / 2),
            "i32": np.int32(k),
            "u8": np.uint8(k),
            "f": k / 2,
            "i": k,
            "b": k % 2 == 0,
        }
        return obs, reward, terminated, truncated, info


def test_info_scalars_keep_the_types_sb3_gives() -> None:
    """The oracle: SB3's own vector env (``DummyVecEnv`` hands infos over exactly as
    ``SubprocVecEnv`` does, pickling aside): ``np.float32`` stays ``np.float32``, a Python
    ``float`` stays ``float``."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    factory = functools.partial(TypedInfoEnv, 3)
    ours = make_sb3(factory, 2, backend="serial")
    theirs = DummyVecEnv([factory, factory])
    try:
        ours.reset()
        theirs.reset()
        for _ in range(4):
            mine, sb3 = ours.step(np.zeros(2, np.int64))[3], theirs.step(np.zeros(2, np.int64))[3]
            for a, b in zip(mine, sb3, strict=True):
                keys = ("f32", "i32", "u8", "f", "i", "b")
                assert {k: (type(a[k]), a[k]) for k in keys} == {
                    k: (type(b[k]), b[k]) for k in keys
                }
    finally:
        ours.close()
        theirs.close()


def test_without_sb3_the_import_says_what_to_install() -> None:
    code = "import sys; sys.modules['stable_baselines3'] = None; import envfleet.sb3"
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == "ImportError: envfleet.sb3 needs Stable-Baselines3: pip install 'envfleet[sb3]'"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_learns_cartpole() -> None:
    """PPO (RL Zoo's CartPole settings) reaches a mean return of 195 over 20 episodes."""
    torch = pytest.importorskip("torch")
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.utils import LinearSchedule

    torch.set_num_threads(1)

    class UntilSolved(BaseCallback):  # type: ignore[misc]
        """Stops at a mean return >= 195 over the last 20 episodes, tallying returns itself."""

        def __init__(self) -> None:
            super().__init__()
            self.solved_at: int | None = None
            self.returns: list[float] = []
            self.reported: list[float] = []  # by RecordEpisodeStatistics, through the adapter
            self.running = np.zeros(8)

        def _on_step(self) -> bool:
            self.running += self.locals["rewards"]
            for i in np.flatnonzero(self.locals["dones"]):
                self.returns.append(float(self.running[i]))
                self.reported.append(self.locals["infos"][i]["episode"]["r"])
                self.running[i] = 0.0
            if len(self.returns) >= 20 and np.mean(self.returns[-20:]) >= 195:
                self.solved_at = self.num_timesteps
                return False
            return True

    started = time.monotonic()
    venv = make_sb3(
        "CartPole-v1",
        8,
        backend="process",
        num_workers=2,
        seed=0,
        wrappers=[RecordEpisodeStatistics],
    )
    try:
        model = PPO(
            "MlpPolicy",
            venv,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=LinearSchedule(1e-3, 0.0, 1.0),
            clip_range=LinearSchedule(0.2, 0.0, 1.0),
            stats_window_size=20,
            seed=0,
            device="cpu",
        )
        callback = UntilSolved()
        model.learn(60_000, callback=callback)
    finally:
        venv.close()
    elapsed = time.monotonic() - started
    assert callback.solved_at is not None, (
        f"mean return of the last 20 episodes {np.mean(callback.returns[-20:]):.1f} < 195 "
        f"after {model.num_timesteps} steps ({elapsed:.0f}s)"
    )
    assert callback.solved_at <= 60_000
    # The episode statistics SB3 reads from the converted infos agree with the tally.
    assert callback.reported == callback.returns
    assert len(model.ep_info_buffer) > 0


def _plain_env() -> gymnasium.Env[Any, Any]:
    return StepEnv(100)


def _monitored_env() -> gymnasium.Env[Any, Any]:
    return Monitor(StepEnv(100))


def _short_env() -> gymnasium.Env[Any, Any]:
    return TimeLimit(StepEnv(100), max_episode_steps=3)


HETEROGENEOUS = [_plain_env, _monitored_env, _short_env]
"""SB3 users' ``env_fns``: each env built its own way (a Monitor on one, a time limit on one)."""


def check_env_fns_match_subproc_vec_env(**make_kwargs: Any) -> None:
    """``make_sb3(env_fns)`` builds env ``i`` with ``env_fns[i]``, as ``SubprocVecEnv`` does.

    The reference ``SubprocVecEnv`` forks its processes (made first, before any thread of ours
    runs): its results do not depend on how they start, and its default (a fork server, which
    the leak check stops after every test) would start one more Python per test and import the
    torch this module's functions bring, in each of its processes (7-15 s a test here). A fork
    server would also outlive the test under Ray's leak check."""
    theirs = SubprocVecEnv(HETEROGENEOUS, start_method="fork")
    try:
        ours = make_sb3(HETEROGENEOUS, len(HETEROGENEOUS), **make_kwargs)
    except BaseException:
        theirs.close()
        raise
    try:
        assert ours.env_is_wrapped(Monitor) == theirs.env_is_wrapped(Monitor) == [F, T, F]
        assert ours.env_is_wrapped(TimeLimit) == [F, F, T]  # SB3 names it by class as well
        np.testing.assert_array_equal(ours.reset(), theirs.reset())
        actions = np.zeros(3, dtype=np.int64)
        for step in range(7):
            got, want = ours.step(actions), theirs.step(actions)
            for a, b in zip(got[:3], want[:3], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
            for mine, sb3 in zip(got[3], want[3], strict=True):
                assert mine.keys() == sb3.keys(), step
                assert mine[TIME_LIMIT] == sb3[TIME_LIMIT], step
                if "terminal_observation" in sb3:
                    np.testing.assert_array_equal(
                        mine["terminal_observation"], sb3["terminal_observation"]
                    )
        assert got[2].tolist() == [F, F, F] and want[2].tolist() == [F, F, F]
    finally:
        ours.close()
        theirs.close()


F, T = False, True
TIME_LIMIT = "TimeLimit.truncated"


@pytest.mark.parametrize(
    "make_kwargs",
    [
        dict(backend="serial"),
        dict(backend="thread"),
        dict(backend="process", num_workers=2),
        dict(backend="process", num_workers=3, start_method="spawn"),
    ],
    ids=["serial", "thread", "process", "process-spawn"],
)
def test_env_fns_through_make_sb3_match_subproc_vec_env(make_kwargs: dict[str, Any]) -> None:
    check_env_fns_match_subproc_vec_env(**make_kwargs)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_start_method_is_the_process_backends_context(start_method: str) -> None:
    """SB3's ``SubprocVecEnv(env_fns, start_method=...)`` keyword, accepted as such."""
    IN_PARENT.append(True)
    try:
        venv = make_sb3([InheritingEnv] * 2, backend="process", start_method=start_method)
    finally:
        IN_PARENT.clear()
    try:
        assert venv.get_attr("inherited") == [start_method == "fork"] * 2
    finally:
        venv.close()
    with pytest.raises(ValueError, match="start_method='spawn' and context='fork'"):
        make_sb3(HETEROGENEOUS, backend="process", start_method="spawn", context="fork")
