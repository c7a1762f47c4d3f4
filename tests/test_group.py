"""EnvGroup on its own (no pool, no worker): the one stepping loop every backend runs.

The oracle is Gymnasium's ``SyncVectorEnv`` stepping the same envs with the same seeds and
actions, in each autoreset mode; failures are checked as records (index, phase, traceback).
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import RecordEpisodeStatistics

import envfleet.group
from envfleet.buffers import Batch, put, take
from envfleet.errors import OnError, Phase
from envfleet.group import RESTARTED, EnvGroup, GroupStartError, derive_seed
from envfleet.infos import merge_infos
from envfleet.spec import EnvSpec
from tests.envs import DictTupleEnv, FaultyEnv

N = 3
STEPS = 40


@pytest.fixture(autouse=True, params=["env-by-env", "batched"])
def stepping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths of ``EnvGroup.step``: env by env, and batched (results
    collected, then written with one assignment per field), which groups of at least
    ``BATCHED_MIN_ENVS`` envs take; here it is made to take every group."""
    least = 1 if request.param == "batched" else 1 << 30
    monkeypatch.setattr(envfleet.group, "BATCHED_MIN_ENVS", least)
    return str(request.param)


class FrameEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    """Frames larger than ``SMALL_ROW_BYTES`` (written row by row) and actions of two floats,
    which the env keeps: the action it got must not change under it."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, shape=(24, 48), dtype=np.uint8)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.kept: list[tuple[np.ndarray, np.ndarray]] = []
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.integers(0, 256, (24, 48), dtype=np.uint8), {"t": 0}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.kept.append((action, action.copy()))
        self.t += 1
        frame = self.np_random.integers(0, 256, (24, 48), dtype=np.uint8)
        info = {"t": self.t} if self.t % 3 == 0 else {}
        return frame, float(action.sum()), self.t % 7 == 0, self.t % 5 == 0, info


def _group(
    spec: EnvSpec, mode: AutoresetMode, n: int = N, **kwargs: Any
) -> tuple[EnvGroup, Batch, gymnasium.Env[Any, Any]]:
    probe = spec.build()
    batch = Batch.local(probe.observation_space, probe.action_space, n)
    group = EnvGroup(
        spec, range(n), batch, mode, probe.observation_space, probe.action_space, **kwargs
    )
    return group, batch, probe


def _assert_same(ours: Any, theirs: Any) -> None:
    """Equal nested batches (dicts, tuples, arrays), dtypes included."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs)
        for key in theirs:
            _assert_same(ours[key], theirs[key])
    elif isinstance(theirs, tuple):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _assert_same(a, b)
    elif isinstance(theirs, np.ndarray) and theirs.dtype != object:
        ours = np.asarray(ours)
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, np.ndarray):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _assert_same(a, b)
    else:
        assert ours == theirs


def _infos(reply_infos: dict[int, Any] | None, n: int) -> dict[str, Any]:
    return merge_infos(list(((reply_infos or {}).get(i), i) for i in range(n)), n)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_steps_like_sync_vector_env(mode: AutoresetMode) -> None:
    spec = EnvSpec(DictTupleEnv)
    group, batch, probe = _group(spec, mode)
    oracle = SyncVectorEnv([DictTupleEnv] * N, autoreset_mode=mode)
    ids = list(range(N))
    try:
        reply = group.reset(ids, [7 + i for i in ids], None)
        obs, info = oracle.reset(seed=7)
        assert reply.env_ids == tuple(ids) and not reply.failures
        _assert_same(take(probe.observation_space, batch.observations, None), obs)
        _assert_same(_infos(reply.infos, N), info)
        oracle.action_space.seed(3)
        ended = 0
        for _ in range(STEPS):
            actions = oracle.action_space.sample()
            put(probe.action_space, batch.actions, None, actions)
            reply = group.step(ids)
            obs, rewards, terms, truncs, info = oracle.step(actions)
            assert not reply.failures
            _assert_same(take(probe.observation_space, batch.observations, None), obs)
            np.testing.assert_array_equal(batch.rewards, rewards)
            np.testing.assert_array_equal(batch.terminations, terms)
            np.testing.assert_array_equal(batch.truncations, truncs)
            _assert_same(_infos(reply.infos, N), info)
            done = terms | truncs
            ended += int(done.sum())
            if mode is AutoresetMode.DISABLED and done.any():
                mask = np.asarray(done)
                reply = group.reset([i for i in ids if mask[i]], [None] * int(mask.sum()), None)
                obs, info = oracle.reset(options={"reset_mask": mask})
                assert not reply.failures
                _assert_same(take(probe.observation_space, batch.observations, None), obs)
        assert ended >= N  # autoreset was exercised, in every env
    finally:
        group.close()
        oracle.close()


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("env", [FaultyEnv, FrameEnv])
def test_array_spaces_step_like_sync_vector_env(env: Any, mode: AutoresetMode) -> None:
    """Box and Discrete spaces (the batched path's), small rows and frames, 9 envs, a subset
    of them and all."""
    n = 9
    group, batch, probe = _group(EnvSpec(env), mode, n=n)
    oracle = SyncVectorEnv([env] * n, autoreset_mode=mode)
    ids = list(range(n))
    try:
        group.reset(ids, [3 + i for i in ids], None)
        oracle.reset(seed=3)
        oracle.action_space.seed(5)
        ended = 0
        for _ in range(STEPS):
            actions = oracle.action_space.sample()
            put(probe.action_space, batch.actions, None, actions)
            reply = group.step(tuple(ids))
            obs, rewards, terms, truncs, info = oracle.step(actions)
            assert not reply.failures
            _assert_same(take(probe.observation_space, batch.observations, None), obs)
            _assert_same(batch.rewards, rewards)
            _assert_same(batch.terminations, terms)
            _assert_same(batch.truncations, truncs)
            _assert_same(_infos(reply.infos, n), info)
            done = terms | truncs
            ended += int(done.sum())
            if mode is AutoresetMode.DISABLED and done.any():
                reply = group.reset(np.flatnonzero(done).tolist(), [None] * int(done.sum()), None)
                obs, _ = oracle.reset(options={"reset_mask": done})
                _assert_same(take(probe.observation_space, batch.observations, None), obs)
        assert ended >= n
        if env is FrameEnv:  # every action an env kept is still the one it was given
            for i in ids:
                for given, copied in group.envs[i].unwrapped.kept:  # type: ignore[attr-defined]
                    np.testing.assert_array_equal(given, copied)
    finally:
        group.close()
        oracle.close()


def test_only_the_named_envs_step_in_any_order() -> None:
    group, batch, _ = _group(EnvSpec(FaultyEnv), AutoresetMode.NEXT_STEP, n=10)
    try:
        group.reset(list(range(10)), list(range(1, 11)), None)
        batch.actions[:] = np.arange(10) % 3
        assert not group.step((7, 2, 9, 4)).failures
        assert batch.observations[:, 0].tolist() == [
            100 * (i + 1) + (i in (2, 4, 7, 9)) for i in range(10)
        ]
        assert batch.rewards.tolist() == [
            float(i % 3) if i in (2, 4, 7, 9) else 0.0 for i in range(10)
        ]
    finally:
        group.close()


@pytest.mark.parametrize("ids", [(7, 2, 9, 4), (2, 3, 4, 5)], ids=["scattered", "consecutive"])
def test_flags_of_episodes_that_go_on_are_written_in_their_rows_only(
    ids: tuple[int, ...],
) -> None:
    """No episode ends (flags written as one value for all): the named rows are cleared, the
    others keep what they held; then one ends, and only its row says so."""
    group, batch, _ = _group(EnvSpec(FaultyEnv), AutoresetMode.NEXT_STEP, n=10)
    try:
        group.reset(list(range(10)), list(range(1, 11)), None)
        batch.actions[:] = 1
        batch.terminations[:] = batch.truncations[:] = True
        assert not group.step(ids).failures
        assert np.flatnonzero(~batch.terminations).tolist() == sorted(ids)
        assert np.flatnonzero(~batch.truncations).tolist() == sorted(ids)
        group.set_attr("episode_length", {ids[1]: 2})
        assert not group.step(ids).failures
        assert np.flatnonzero(batch.terminations[list(ids)]).tolist() == [1]
        assert not batch.truncations[list(ids)].any()
    finally:
        group.close()


def test_flags_written_env_by_env_are_cleared_by_the_next_batched_step() -> None:
    """The batched step skips clearing flags it left clear; an episode that ends on the
    env-by-env path (here: actions carried with the command) must still be cleared by the
    next batched step of the same command."""
    group, batch, _ = _group(EnvSpec(FaultyEnv), AutoresetMode.NEXT_STEP, n=6)
    ids = tuple(range(6))
    try:
        group.reset(list(ids), list(range(1, 7)), None)
        group.set_attr("episode_length", {i: 302 if i == 2 else 10**6 for i in ids})
        batch.actions[:] = 1
        assert not group.step(ids).failures  # every episode goes on: flags clear
        carried = {i: np.int64(1) for i in ids}
        assert not group.step(ids, carried).failures  # env 2's episode ends
        assert batch.terminations.tolist() == [i == 2 for i in ids]
        assert not group.step(ids).failures  # env 2 resets, the others go on
        assert not batch.terminations.any() and not batch.truncations.any()
    finally:
        group.close()


def test_the_command_repeated_every_step_steps_the_envs_of_the_moment() -> None:
    """A worker repeats one command (the same tuple) every step, and the group keeps what it
    needs for it: a restarted env is stepped, not the one it replaced, and a command for other
    envs in between changes nothing for it."""
    spec = EnvSpec(functools.partial(FaultyEnv, step_hook=_raise_at_step_2_of_env_1))
    group, batch, _ = _group(spec, AutoresetMode.NEXT_STEP, on_error=OnError.RESTART, seed_base=5)
    ids = (0, 1, 2)
    try:
        group.reset(list(ids), [1, 2, 3], None)
        batch.actions[:] = 1
        assert not group.step(ids).restarts
        assert [f.env_index for f in group.step(ids).restarts] == [1]
        group.step(ids)  # env 1, fresh, starts over with the derived seed; 0 and 2 go on
        assert group.envs[1].unwrapped.seed_used == derive_seed(5, 1, 1)  # type: ignore[attr-defined]
        fresh = derive_seed(5, 1, 1) * 100  # type: ignore[operator]
        assert batch.observations[:, 0].tolist() == [103, fresh, 303]
        group.step((2,))
        group.step(ids)
        assert batch.observations[:, 0].tolist() == [104, fresh + 1, 305]
    finally:
        group.close()


def _wrong_shape_in_env_4(env: FaultyEnv, action: Any) -> np.ndarray | None:
    return np.array([1, 2]) if env.seed_used == 5 else None


def test_an_observation_that_does_not_fit_fails_its_env_only() -> None:
    spec = EnvSpec(functools.partial(FaultyEnv, step_hook=_wrong_shape_in_env_4))
    group, batch, _ = _group(spec, AutoresetMode.NEXT_STEP, n=9)
    try:
        group.reset(list(range(9)), list(range(1, 10)), None)
        batch.actions[:] = 1
        reply = group.step(tuple(range(9)))
        (failure,) = reply.failures
        assert (failure.env_index, failure.phase, failure.type_name) == (
            4,
            Phase.STEP,
            "ValueError",
        )
        assert "does not fit its observation space" in failure.message
        expected = [100 * (i + 1) + 1 for i in range(9)]
        expected[4] = 500  # env 4's row untouched
        assert batch.observations[:, 0].tolist() == expected
    finally:
        group.close()


class SmallObsEnv(gymnasium.Env[np.ndarray, int]):
    """Observations of four floats (rows gathered at once); env ``bad`` (by seed) returns
    ``shape_of_bad`` instead: every env when ``bad`` is None."""

    def __init__(self, bad: int | None, shape_of_bad: tuple[int, ...]) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.bad, self.shape_of_bad, self.seed_used = bad, shape_of_bad, -1

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.seed_used = -1 if seed is None else seed
        return np.full(4, self.seed_used, dtype=np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        wrong = self.bad is None or self.seed_used == self.bad
        shape = self.shape_of_bad if wrong else (4,)
        return np.full(shape, 10 + self.seed_used, dtype=np.float32), 1.0, False, False, {}


@pytest.mark.parametrize(
    ("bad", "shape_of_bad"),
    [(None, (1,)), (None, (2, 4)), (0, (1,)), (3, ()), (5, (5,))],
    ids=["all-(1,)", "all-(2,4)", "first-(1,)", "one-scalar", "last-(5,)"],
)
def test_small_observations_of_another_shape_are_never_broadcast(
    bad: int | None, shape_of_bad: tuple[int, ...]
) -> None:
    """Rows gathered at once: an observation of another shape (even when every env returns
    that shape, which numpy would broadcast into the rows) fails its env, naming it, and the
    others' rows are written."""
    spec = EnvSpec(functools.partial(SmallObsEnv, bad, shape_of_bad))
    group, batch, _ = _group(spec, AutoresetMode.NEXT_STEP, n=6)
    try:
        group.reset(list(range(6)), list(range(6)), None)
        batch.actions[:] = 1
        reply = group.step(tuple(range(6)))
        failed = list(range(6)) if bad is None else [bad]
        assert [f.env_index for f in reply.failures] == failed
        assert all("does not fit its observation space" in f.message for f in reply.failures)
        expected = [float(i if i in failed else 10 + i) for i in range(6)]
        assert batch.observations[:, 0].tolist() == expected
        assert batch.observations[:, 3].tolist() == expected
    finally:
        group.close()


class ExtraValueEnv(FaultyEnv):
    """Env 5 (seeded 6) returns six values from ``step``, the others five."""

    def step(self, action: Any) -> Any:
        result = super().step(action)
        return (*result, "extra") if self.seed_used == 6 else result


@pytest.mark.parametrize("on_error", [OnError.RAISE, OnError.RESTART])
def test_a_step_that_returns_six_values_fails_its_env_only(on_error: OnError) -> None:
    group, batch, _ = _group(
        EnvSpec(ExtraValueEnv), AutoresetMode.NEXT_STEP, n=9, on_error=on_error
    )
    try:
        group.reset(list(range(9)), list(range(1, 10)), None)
        batch.actions[:] = 2
        reply = group.step(tuple(range(9)))
        failure = reply.failures[0] if on_error is OnError.RAISE else reply.restarts[0]
        assert (failure.env_index, failure.phase, failure.type_name) == (
            5,
            Phase.STEP,
            "ValueError",
        )
        assert "too many values" in failure.message
        rows = [100 * (i + 1) + 1 for i in range(9)]
        rows[5] = 600  # its row as it was
        assert batch.observations[:, 0].tolist() == rows
        assert batch.rewards.tolist() == [0.0 if i == 5 else 2.0 for i in range(9)]
    finally:
        group.close()


def test_seeds_decide_the_trajectory() -> None:
    def first_obs(seeds: list[int]) -> np.ndarray:
        group, batch, _ = _group(EnvSpec(DictTupleEnv), AutoresetMode.NEXT_STEP)
        try:
            group.reset(list(range(N)), seeds, None)
            return np.array(batch.observations["pos"])
        finally:
            group.close()

    same = first_obs([1, 2, 3])
    np.testing.assert_array_equal(same, first_obs([1, 2, 3]))
    assert not np.array_equal(same, first_obs([4, 5, 6]))
    assert not np.array_equal(same[0], same[1])  # env seeds differ, so do their walks


def test_only_named_rows_are_written() -> None:
    group, batch, _ = _group(EnvSpec(FaultyEnv), AutoresetMode.NEXT_STEP)
    try:
        group.reset([0, 1, 2], [1, 2, 3], None)
        batch.actions[:] = [1, 2, 0]
        group.step([1])
        assert batch.observations[:, 0].tolist() == [100, 201, 300]
        assert batch.rewards.tolist() == [0.0, 2.0, 0.0]
    finally:
        group.close()


def test_episode_statistics_match_the_oracle() -> None:
    spec = EnvSpec(DictTupleEnv, wrappers=(RecordEpisodeStatistics,))
    group, batch, probe = _group(spec, AutoresetMode.NEXT_STEP)
    factory = functools.partial(spec.build)
    oracle = SyncVectorEnv([factory] * N)
    ids = list(range(N))
    episodes = 0
    try:
        group.reset(ids, [11 + i for i in ids], None)
        oracle.reset(seed=11)
        for _ in range(STEPS):
            actions = np.zeros((N, 2), dtype=np.float32)
            put(probe.action_space, batch.actions, None, actions)
            reply = group.step(ids)
            info = oracle.step(actions)[4]
            ours = _infos(reply.infos, N)
            assert ("episode" in ours) == ("episode" in info)
            if "episode" in info:
                episodes += int(info["_episode"].sum())
                np.testing.assert_array_equal(ours["_episode"], info["_episode"])
                np.testing.assert_array_equal(ours["episode"]["r"], info["episode"]["r"])
                np.testing.assert_array_equal(ours["episode"]["l"], info["episode"]["l"])
        assert episodes >= N
    finally:
        group.close()
        oracle.close()


def _raise_at_step_2_of_env_1(env: FaultyEnv, action: Any) -> None:
    if env.seed_used == 2 and env.count == 201:
        raise KeyError("boom at step 2")


def test_a_failing_env_is_reported_and_the_others_step() -> None:
    spec = EnvSpec(functools.partial(FaultyEnv, step_hook=_raise_at_step_2_of_env_1))
    group, batch, _ = _group(spec, AutoresetMode.NEXT_STEP)
    try:
        group.reset([0, 1, 2], [1, 2, 3], None)
        batch.actions[:] = 1
        assert not group.step([0, 1, 2]).failures
        reply = group.step([0, 1, 2])
        (failure,) = reply.failures
        assert (failure.env_index, failure.phase, failure.type_name) == (1, Phase.STEP, "KeyError")
        assert "boom at step 2" in failure.message
        assert "_raise_at_step_2_of_env_1" in failure.traceback  # where it was raised
        original = failure.original()
        assert isinstance(original, KeyError)
        assert batch.observations[:, 0].tolist() == [102, 201, 302]  # env 1's row untouched
    finally:
        group.close()


def test_restart_replaces_the_env_and_truncates_its_episode() -> None:
    spec = EnvSpec(functools.partial(FaultyEnv, step_hook=_raise_at_step_2_of_env_1))
    group, batch, _ = _group(spec, AutoresetMode.NEXT_STEP, on_error=OnError.RESTART, seed_base=5)
    try:
        group.reset([0, 1, 2], [1, 2, 3], None)
        batch.actions[:] = 1
        group.step([0, 1, 2])
        reply = group.step([0, 1, 2])
        assert not reply.failures
        (logged,) = reply.restarts
        assert (logged.env_index, logged.phase) == (1, Phase.STEP)
        assert reply.infos is not None and reply.infos[1] == {RESTARTED: True}
        assert batch.truncations.tolist() == [False, True, False]
        assert batch.rewards[1] == 0.0
        assert group.restarts == {0: 0, 1: 1, 2: 0}
        group.step([0, 1, 2])  # next step: the fresh env starts with the derived seed
        assert group.envs[1].unwrapped.seed_used == derive_seed(5, 1, 1)  # type: ignore[attr-defined]
    finally:
        group.close()


def _fail_build() -> gymnasium.Env[Any, Any]:
    raise OSError("no simulator here")


def test_a_failing_build_is_a_make_failure() -> None:
    probe = FaultyEnv()
    batch = Batch.local(probe.observation_space, probe.action_space, 2)
    with pytest.raises(GroupStartError) as caught:
        EnvGroup(
            EnvSpec(_fail_build),
            [0, 1],
            batch,
            AutoresetMode.NEXT_STEP,
            probe.observation_space,
            probe.action_space,
        )
    failure = caught.value.failure
    assert (failure.env_index, failure.phase, failure.type_name) == (0, Phase.MAKE, "OSError")
    assert "_fail_build" in failure.traceback


def test_call_and_set_attr_reach_every_env() -> None:
    group, _, _ = _group(EnvSpec(FaultyEnv), AutoresetMode.NEXT_STEP)
    try:
        assert group.set_attr("episode_length", {0: 2, 1: 3, 2: 4}).failures == ()
        assert group.call("episode_length", (), {}).values == {0: 2, 1: 3, 2: 4}
        reply = group.call("no_such_method", (), {})
        assert {f.env_index for f in reply.failures} == {0, 1, 2}
        assert {f.phase for f in reply.failures} == {Phase.CALL}
    finally:
        group.close()


def test_observations_of_the_rows_dtype_are_not_checked_one_by_one_when_it_came_pickled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's batch has its spaces unpickled: their dtype equals numpy's own but is another
    object. Observations of that dtype still take the one-test path (no per-env
    ``fits_dtype``), as in a batch made here."""
    import pickle

    import envfleet.batch_rows

    probe = gymnasium.make("Pendulum-v1")
    came = pickle.loads(pickle.dumps(probe.observation_space))
    assert came.dtype == np.float32 and came.dtype is not np.dtype(np.float32)
    spec = EnvSpec.from_user("Pendulum-v1", None)
    batch = Batch.local(came, probe.action_space, 4)
    group = EnvGroup(spec, range(4), batch, AutoresetMode.NEXT_STEP, came, probe.action_space)
    checked: list[Any] = []
    real = envfleet.batch_rows.fits_dtype

    def counted(value: Any, dtype: Any) -> bool:
        checked.append(value)
        return real(value, dtype)

    monkeypatch.setattr(envfleet.batch_rows, "fits_dtype", counted)
    group.reset(range(4), [0, 1, 2, 3], None)
    for _ in range(3):
        group.step(range(4))
    assert checked == []
    group.close()
