"""Observations of another dtype than their space's: accepted or refused as Gymnasium does.

``SyncVectorEnv`` writes observations with ``concatenate`` (``np.stack(..., out=)``, numpy's
``same_kind`` casting, each observation on its own): an int64 observation for an int32 space or
a float64 one for a float32 space is cast; a float one for a uint8 space, a signed one for an
unsigned space, an int one for a bool space raise ``TypeError``. envfleet accepts exactly the
same, on every backend and whichever way the rows are written (gathered at once, row by row,
frames), and refuses the rest as that env's failure: an ``EnvError`` that is also a
``TypeError``, naming the env, the phase and both dtypes, raised before the row is written.
"""

from __future__ import annotations

import functools
from contextlib import closing
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

import envfleet
from envfleet.buffers import Batch
from envfleet.errors import Phase
from envfleet.group import EnvGroup
from envfleet.spec import EnvSpec

NUM_ENVS = 8
BAD = 5
"""The env that returns the observation of another dtype."""


class DtypeEnv(gymnasium.Env[Any, int]):
    """Observations of ``space``, filled with the step count; env ``bad`` returns ``value``
    instead, at reset (``at_reset``) or at its second step."""

    def __init__(
        self, space: spaces.Space[Any], bad: bool, value: Any, at_reset: bool = False
    ) -> None:
        self.observation_space = space
        self.action_space = spaces.Discrete(2)  # type: ignore[assignment]
        self.bad, self.value, self.at_reset = bad, value, at_reset
        self.t = 0

    def _obs(self) -> Any:
        if self.bad and (self.at_reset if self.t == 0 else self.t == 2):
            return self.value
        return _filled(self.observation_space, self.t)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return self._obs(), 1.0, False, False, {}


def _filled(space: spaces.Space[Any], t: int) -> Any:
    if isinstance(space, spaces.Dict):
        return {key: _filled(sub, t) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Text):
        return "ab"
    assert space.dtype is not None and space.shape is not None
    return np.full(space.shape, t % 2, dtype=space.dtype)


UINT8_4 = spaces.Box(0, 255, shape=(4,), dtype=np.uint8)
INT32_4 = spaces.Box(-10, 10, shape=(4,), dtype=np.int32)
FLOAT32_4 = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
FRAMES = spaces.Box(0, 255, shape=(24, 24, 3), dtype=np.uint8)  # > 1024 bytes: row by row
DICT = spaces.Dict({"pos": FLOAT32_4, "img": spaces.Box(0, 255, shape=(3,), dtype=np.uint8)})
WITH_TEXT = spaces.Dict({"name": spaces.Text(5), "img": DICT["img"]})  # stored whole, pickled

CASES: dict[str, tuple[spaces.Space[Any], Any]] = {
    "uint8<-float64": (UINT8_4, np.array([300.7, -1.0, np.nan, 2.0])),
    "uint8<-int64": (UINT8_4, np.array([1, 2, 3, 300], np.int64)),
    "uint8-frames<-float64": (FRAMES, np.full((24, 24, 3), 7.5)),
    "dict-uint8<-float64": (
        DICT,
        {"pos": np.zeros(4, np.float32), "img": np.array([1.0, 2.0, 3.0])},
    ),
    "dict-with-text-uint8<-float64": (WITH_TEXT, {"name": "c", "img": np.array([1.0, 2, 3])}),
    "discrete<-python-float": (spaces.Discrete(5), 2.0),
    "discrete<-float32": (spaces.Discrete(5), np.float32(2)),
    "float32<-object": (FLOAT32_4, np.array([1, 2, 3, 4], dtype=object)),
    # Legal: same_kind casts, values as numpy casts them (2**40 wraps in int32, as in Gymnasium).
    "int32<-int64": (INT32_4, np.array([1, -2, 3, 2**40], np.int64)),
    "float32<-float64": (FLOAT32_4, np.array([0.1, 1e300, -1e-300, np.nan])),
    "float32<-int64": (FLOAT32_4, np.array([1, 2, 3, 4], np.int64)),
    "uint8-frames<-bool": (FRAMES, np.ones((24, 24, 3), np.bool_)),
    "discrete<-python-int": (spaces.Discrete(5), 3),
    "discrete<-uint8": (spaces.Discrete(5), np.uint8(4)),
    "multibinary<-bool": (spaces.MultiBinary(4), np.array([True, False, True, True])),
    "dict-with-text-int32<-int64": (
        spaces.Dict({"name": spaces.Text(5), "img": INT32_4}),
        {"name": "c", "img": np.array([1, 2, 3, 2**40])},
    ),
}


def _env_fns(space: spaces.Space[Any], value: Any, at_reset: bool) -> list[Any]:
    return [functools.partial(DtypeEnv, space, i == BAD, value, at_reset) for i in range(NUM_ENVS)]


def _run(vec: Any) -> tuple[str, Any]:
    """Reset and step twice: ``("ok", observations after each call)`` or the exception."""
    seen = []
    try:
        seen.append(vec.reset(seed=0)[0])
        for _ in range(2):
            seen.append(vec.step(np.zeros(NUM_ENVS, np.int64))[0])
    except Exception as exc:  # the exception is what is compared
        return "raised", exc
    return "ok", seen


def _assert_same(ours: Any, theirs: Any) -> None:
    """Equal nested batches, dtypes included (NaN equal to NaN)."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs)
        for key in theirs:
            _assert_same(ours[key], theirs[key])
    elif isinstance(theirs, tuple):  # a Text part: one string per env
        assert ours == theirs
    else:
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)


RUNS = [(case, False) for case in CASES] + [
    (case, True) for case in ("uint8<-float64", "discrete<-python-float", "int32<-int64")
]
"""Each case at the bad env's second step; a few at its reset too."""


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e300 as well
@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(
    ("case", "at_reset"), RUNS, ids=[f"{c}-{'reset' if r else 'step'}" for c, r in RUNS]
)
def test_same_acceptance_as_sync_vector_env(
    backend: str, num_workers: int, case: str, at_reset: bool
) -> None:
    """Every backend accepts what ``SyncVectorEnv`` accepts, with its values and dtypes, and
    refuses what it refuses with a ``TypeError`` that names the env, the phase and the
    dtypes. One worker: the envs' rows are gathered at once; two: written env by env."""
    if backend == "serial" and num_workers == 2:
        pytest.skip("serial has one group whatever num_workers says")
    space, value = CASES[case]
    env_fns = _env_fns(space, value, at_reset)
    with closing(SyncVectorEnv(env_fns)) as reference:
        expected, theirs = _run(reference)
    with envfleet.make(env_fns, backend=backend, num_workers=num_workers) as pool:
        got, ours = _run(pool)
    assert got == expected, f"Gymnasium: {theirs!r}; envfleet: {ours!r}"
    if expected == "ok":
        for a, b in zip(ours, theirs, strict=True):
            _assert_same(a, b)
        return
    assert isinstance(theirs, TypeError), theirs
    assert isinstance(ours, TypeError), repr(ours)
    assert isinstance(ours, envfleet.EnvError)
    assert ours.env_index == BAD
    assert ours.phase is (Phase.RESET if at_reset else Phase.STEP)
    message = str(ours)
    assert f"env {BAD}" in message
    assert "same_kind" in message
    source = np.asarray(value["img"] if isinstance(value, dict) else value).dtype
    target = (space["img"] if isinstance(space, spaces.Dict) else space).dtype
    assert f"dtype {source}" in message and f"dtype {target}" in message
    if at_reset:  # nothing completed at reset; at a step, the other envs' rows did
        return
    assert ours.completed is not None
    assert sorted(ours.completed[4]["env_id"].tolist()) == [i for i in range(NUM_ENVS) if i != BAD]


def test_a_refused_observation_leaves_the_envs_row_as_it_was(backend: str) -> None:
    """Refused before it is written: under ``on_error="restart"`` the env's last observation
    stands (nothing cast into its row), its episode is truncated and the others go on."""
    env_fns = _env_fns(UINT8_4, np.array([300.7, -1.0, np.nan, 2.0]), False)
    with envfleet.make(env_fns, backend=backend, num_workers=1, on_error="restart") as pool:
        pool.reset(seed=0)
        first, *_ = pool.step(np.zeros(NUM_ENVS, np.int64))
        obs, _, _, truncs, _ = pool.step(np.zeros(NUM_ENVS, np.int64))
        assert truncs.tolist() == [i == BAD for i in range(NUM_ENVS)]
        assert obs[BAD].tolist() == first[BAD].tolist() == [1, 1, 1, 1]
        assert pool.restarts.tolist() == [int(i == BAD) for i in range(NUM_ENVS)]


SPACE_DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]
OBS_DTYPES = [*SPACE_DTYPES, np.bool_, np.uint64, np.complex128, np.object_]


@settings(max_examples=80, deadline=None)
@given(
    space_dtype=st.sampled_from(SPACE_DTYPES),
    obs_dtype=st.sampled_from(OBS_DTYPES),
    shape=st.sampled_from([(), (3,), (20, 20)]),
    num_envs=st.sampled_from([2, 7]),
    bad=st.integers(0, 6),
)
def test_group_accepts_what_concatenate_accepts(
    space_dtype: Any, obs_dtype: Any, shape: tuple[int, ...], num_envs: int, bad: int
) -> None:
    """The stepping loop itself, every way it writes rows (scalars, small rows gathered at
    once from 6 envs on, frames row by row), against ``SyncVectorEnv`` for dtype pairs."""
    bad %= num_envs
    space = spaces.Box(0, 1, shape=shape, dtype=space_dtype)
    value = np.ones(shape, dtype=obs_dtype)
    env_fns = [functools.partial(DtypeEnv, space, i == bad, value) for i in range(num_envs)]
    with closing(SyncVectorEnv(env_fns)) as reference:
        reference.reset(seed=0)
        reference.step(np.zeros(num_envs, np.int64))
        try:
            theirs = reference.step(np.zeros(num_envs, np.int64))[0]
        except TypeError:
            theirs = None
    batch_actions = spaces.Discrete(2)
    batch = Batch.local(space, batch_actions, num_envs)
    group = EnvGroup(
        EnvSpec.from_user(env_fns),
        range(num_envs),
        batch,
        AutoresetMode.NEXT_STEP,
        space,
        batch_actions,
    )
    try:
        ids = tuple(range(num_envs))
        group.reset(ids, list(ids), None)
        batch.actions[:] = 0
        assert not group.step(ids).failures
        reply = group.step(ids)
    finally:
        group.close()
    if theirs is None:
        (failure,) = reply.failures
        assert (failure.env_index, failure.phase, failure.type_name) == (
            bad,
            Phase.STEP,
            "TypeError",
        )
        assert batch.observations[bad].tolist() == np.ones(shape).tolist()  # not overwritten
    else:
        assert not reply.failures
        _assert_same(batch.observations, theirs)
