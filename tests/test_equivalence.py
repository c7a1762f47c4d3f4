"""Same seed, same actions: same results, whatever the backend and however envs are split.

Every backend configuration must be bit-identical to Gymnasium's ``SyncVectorEnv`` built from the
same env factory, step by step, in all three autoreset modes, infos and ``_key`` masks included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

import ale_py
import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space, iterate

import envfleet
from tests.conftest import BACKENDS, WORKER_BACKENDS, WORKER_COUNTS
from tests.envs import DictTupleEnv, FaultyEnv

gymnasium.register_envs(ale_py)

NUM_ENVS = 7
SEED = 42
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@dataclass(frozen=True)
class Case:
    env: Any  # what envfleet.make gets: an id or an env class
    steps: int
    min_episodes: int  # episodes that must end over the run, so autoreset is exercised
    kwargs: dict[str, Any] = field(default_factory=dict)

    def factory(self) -> Callable[[], gymnasium.Env[Any, Any]]:
        """The same env as envfleet builds, for SyncVectorEnv."""
        if isinstance(self.env, str):
            return functools.partial(gymnasium.make, self.env, **self.kwargs)
        return functools.partial(self.env, **self.kwargs)


CASES = {
    # CartPole ends in ~20 steps under random actions.
    "CartPole": Case("CartPole-v1", steps=100, min_episodes=15),
    # Pong episodes last thousands of frames: a time limit makes them end (truncated) here.
    "Pong": Case("ALE/Pong-v5", steps=45, min_episodes=14, kwargs={"max_episode_steps": 15}),
    "DictTuple": Case(DictTupleEnv, steps=60, min_episodes=30, kwargs={"max_steps": 12}),
}


class TextDictEnv(gymnasium.Env[dict[str, Any], np.int64]):
    """Observations that do not fit shared arrays (Text inside Dict and Tuple): the pickled path."""

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            {
                "text": spaces.Text(8),
                "pos": spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
                "pair": spaces.Tuple((spaces.Discrete(3), spaces.Text(4))),
            }
        )
        self.action_space = spaces.Discrete(3)
        self._t = 0

    def _obs(self) -> dict[str, Any]:
        rng = self.np_random
        return {
            "text": "ab"[: int(rng.integers(3))] + str(self._t),
            "pos": rng.uniform(-1, 1, size=2).astype(np.float32),
            "pair": (int(rng.integers(3)), "xyz"[: int(rng.integers(1, 4))]),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self._obs(), {"name": f"run-{int(self.np_random.integers(10))}"}

    def step(self, action: int) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self._t += 1
        terminated = self._t >= 3 + int(action)
        return self._obs(), float(action), terminated, False, {"trail": "x" * self._t}


# Not in CASES (which the serial-vs-process test also runs): a case of its own.
PICKLED_CASE = Case(TextDictEnv, steps=30, min_episodes=20)


# -- comparison helpers ----------------------------------------------------------------------


def assert_same(a: Any, b: Any, path: str = "result") -> None:
    """Assert ``a`` and ``b`` are bit-identical: same types, dtypes, shapes, keys and bytes."""
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b).__name__}"
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, tuple | list):
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{k}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: ndarray vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.dtype == object:
            for k, (x, y) in enumerate(zip(a.ravel(), b.ravel(), strict=True)):
                assert_same(x, y, f"{path}[{k}]")
        elif a.tobytes() != b.tobytes():
            np.testing.assert_array_equal(a, b, err_msg=path)
            raise AssertionError(f"{path}: equal values but different bits:\n{a!r}\n{b!r}")
    else:
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


def assert_inside(pool: VectorEnv, obs: Any, infos: dict[str, Any], where: str) -> None:
    """Every observation (and every ``final_obs``) lies inside the pool's single space."""
    space = pool.single_observation_space
    assert pool.observation_space.contains(obs), f"{where}: batch outside {pool.observation_space}"
    for i, single in enumerate(iterate(pool.observation_space, obs)):
        assert space.contains(single), f"{where}: env {i} observation {single!r} outside {space}"
    if "final_obs" in infos:
        for i in np.flatnonzero(infos["_final_obs"]):
            final = infos["final_obs"][i]
            assert space.contains(final), f"{where}: env {i} final_obs outside {space}"


def make_pool(case: Case, config: tuple[str, int | None], mode: AutoresetMode) -> envfleet.Pool:
    backend, num_workers = config
    return envfleet.make(
        case.env,
        NUM_ENVS,
        backend=backend,
        num_workers=num_workers,
        env_kwargs=case.kwargs,
        autoreset_mode=mode,
    )


Record = tuple[str, Any]  # (what happened, its result)


def drive(venv: VectorEnv, case: Case, mode: AutoresetMode) -> Iterator[Record]:
    """Reset ``venv`` with ``SEED`` and step it with seeded random actions, yielding each result.

    In DISABLED mode the envs that ended are reset with ``options={"reset_mask": ...}``, as
    Gymnasium requires. Lazy, so that a comparison stops at the first difference.
    """
    actions_space = batch_space(venv.single_action_space, NUM_ENVS)
    actions_space.seed(SEED)
    yield "reset", venv.reset(seed=SEED)
    for t in range(case.steps):
        result = venv.step(actions_space.sample())
        yield f"step {t}", result
        ended = result[2] | result[3]
        if mode is AutoresetMode.DISABLED and ended.any():
            yield f"reset_mask after step {t}", venv.reset(options={"reset_mask": ended.copy()})


@dataclass(frozen=True)
class ReferenceRun:
    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]
    records: list[Record]


@functools.cache
def reference_run(case_name: str, mode: AutoresetMode) -> ReferenceRun:
    """What SyncVectorEnv gives (computed once per case and mode: Pong is slow to build)."""
    case = CASES.get(case_name, PICKLED_CASE)
    reference = SyncVectorEnv([case.factory()] * NUM_ENVS, autoreset_mode=mode)
    try:
        records = list(drive(reference, case, mode))
        return ReferenceRun(
            reference.single_observation_space, reference.single_action_space, records
        )
    finally:
        reference.close()


def assert_same_run(
    expected: Iterable[Record], pool: envfleet.Pool, case: Case, mode: AutoresetMode, label: str
) -> None:
    """Drive ``pool`` like the expected run and compare every result, step by step."""
    episodes = records = 0
    for (what, want), (what_got, got) in zip_longest(
        expected, drive(pool, case, mode), fillvalue=("<end of run>", None)
    ):
        assert what == what_got, f"{label}: expected {what}, got {what_got}"
        assert_same(want, got, f"{label} {what}")
        infos = got[-1]
        assert_inside(pool, got[0], infos, f"{label} {what}")
        if what.startswith("step"):
            episodes += int((got[2] | got[3]).sum())
        records += 1
    assert records > case.steps
    assert episodes >= case.min_episodes, f"only {episodes} episodes ended: too few steps"


# -- equivalence -------------------------------------------------------------------------------


def check_matches_sync_vector_env(
    case_name: str, mode: AutoresetMode, config: tuple[str, int | None]
) -> None:
    case = CASES[case_name]
    reference = reference_run(case_name, mode)
    with make_pool(case, config, mode) as pool:
        assert pool.single_observation_space == reference.observation_space
        assert pool.single_action_space == reference.action_space
        label = f"{case_name}/{mode.name}/{config}"
        assert_same_run(reference.records, pool, case, mode, label)


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("case_name", [name for name in CASES if name != "Pong"])
def test_matches_sync_vector_env(
    case_name: str, mode: AutoresetMode, pool_config: tuple[str, int | None]
) -> None:
    """Every case, mode, backend and worker layout (Pong's layouts: below)."""
    check_matches_sync_vector_env(case_name, mode, pool_config)


PONG_CONFIGS = [(b, None) for b in BACKENDS if b not in WORKER_BACKENDS] + [
    (b, max(WORKER_COUNTS)) for b in WORKER_BACKENDS
]
"""Pong on every backend, its envs split the most ways (3 + 2 + 2). How envs are split over
workers does not depend on the env: CartPole and DictTuple try every layout above. Pong adds
image observations and ALE's infos, and its every build and seeded reset reloads the game
(0.13 s an env): its other layouts took a third of this module's time."""


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize(
    "config", PONG_CONFIGS, ids=[b if w is None else f"{b}-w{w}" for b, w in PONG_CONFIGS]
)
def test_pong_matches_sync_vector_env(mode: AutoresetMode, config: tuple[str, int | None]) -> None:
    check_matches_sync_vector_env("Pong", mode, config)


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_pickled_observations_match_sync_vector_env(
    mode: AutoresetMode, pool_config: tuple[str, int | None]
) -> None:
    """Text leaves do not fit shared memory: they travel pickled, with the same results."""
    reference = reference_run("TextDict", mode)
    with make_pool(PICKLED_CASE, pool_config, mode) as pool:
        assert pool.single_observation_space == reference.observation_space
        label = f"TextDict/{mode.name}/{pool_config}"
        assert_same_run(reference.records, pool, PICKLED_CASE, mode, label)


@pytest.mark.parametrize("num_workers", WORKER_COUNTS)
@pytest.mark.parametrize("case_name", ["CartPole", "DictTuple"])  # Pong: covered above
def test_serial_and_process_are_bit_identical(case_name: str, num_workers: int) -> None:
    case = CASES[case_name]
    mode = AutoresetMode.SAME_STEP  # infos carry final_obs/final_info: the richest results
    with (
        make_pool(case, ("serial", None), mode) as serial,
        make_pool(case, ("process", num_workers), mode) as process,
    ):
        label = f"{case_name} serial vs process-{num_workers}"
        assert_same_run(drive(serial, case, mode), process, case, mode, label)


# -- seeding -----------------------------------------------------------------------------------


def test_make_seed_is_the_first_reset_seed(backend: str) -> None:
    with (
        envfleet.make("CartPole-v1", NUM_ENVS, backend=backend, seed=SEED) as seeded,
        envfleet.make("CartPole-v1", NUM_ENVS, backend=backend) as unseeded,
    ):
        reference = SyncVectorEnv([CASES["CartPole"].factory()] * NUM_ENVS)
        try:
            expected = reference.reset(seed=SEED)
            assert_same(expected, seeded.reset(), "make(seed=s) then reset()")
            assert_same(expected, unseeded.reset(seed=SEED), "reset(seed=s)")
            actions = np.array([0, 1, 1, 0, 1, 0, 0])
            for t in range(5):
                expected = reference.step(actions)
                assert_same(expected, seeded.step(actions), f"seeded step {t}")
                assert_same(expected, unseeded.step(actions), f"unseeded step {t}")
        finally:
            reference.close()


def test_env_i_is_reset_with_seed_plus_i(backend: str) -> None:
    with envfleet.make(FaultyEnv, NUM_ENVS, backend=backend, num_workers=3, seed=SEED) as pool:
        assert pool.get_attr("seed_used") == (None,) * NUM_ENVS  # nothing reset yet
        obs, _ = pool.reset()
        assert pool.get_attr("seed_used") == tuple(SEED + i for i in range(NUM_ENVS))
        np.testing.assert_array_equal(obs[:, 0], [(SEED + i) * 100 for i in range(NUM_ENVS)])

        # The make() seed is used once: a later reset() without a seed does not reseed.
        obs, _ = pool.reset()
        np.testing.assert_array_equal(obs, np.zeros((NUM_ENVS, 1)))
        assert pool.get_attr("seed_used") == tuple(SEED + i for i in range(NUM_ENVS))

        pool.reset(seed=7)
        assert pool.get_attr("seed_used") == tuple(7 + i for i in range(NUM_ENVS))
        seeds = [3, 1, 4, 1, 5, 9, 2]
        pool.reset(seed=seeds)
        assert pool.get_attr("seed_used") == tuple(seeds)


def test_reset_mask_seeds_only_the_masked_envs(backend: str) -> None:
    with envfleet.make(FaultyEnv, NUM_ENVS, backend=backend, num_workers=3) as pool:
        pool.reset(seed=SEED)
        mask = np.array([False, True, False, False, True, True, False])
        obs, infos = pool.reset(seed=500, options={"reset_mask": mask})
        expected_seeds = [500 + i if m else SEED + i for i, m in enumerate(mask)]
        assert pool.get_attr("seed_used") == tuple(expected_seeds)
        np.testing.assert_array_equal(obs[:, 0], [s * 100 for s in expected_seeds])
        assert infos == {}


def test_different_seeds_give_different_observations(backend: str) -> None:
    with envfleet.make("CartPole-v1", NUM_ENVS, backend=backend) as pool:
        first, _ = pool.reset(seed=0)
        again, _ = pool.reset(seed=0)
        other, _ = pool.reset(seed=1000)
    np.testing.assert_array_equal(first, again)
    for i in range(NUM_ENVS):
        assert not np.array_equal(first[i], other[i]), f"env {i}: seeds 0+i and 1000+i agree"
        for j in range(i):
            assert not np.array_equal(first[i], first[j]), f"envs {i} and {j} share a seed"
