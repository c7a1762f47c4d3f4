"""envfleet as a drop-in for ``SyncVectorEnv``/``AsyncVectorEnv``: value for value.

- ``env_fns`` (one factory per env, envs that differ) give what ``SyncVectorEnv(env_fns)``
  gives, bit for bit, on every backend, in every autoreset mode, sync and async.
- Actions reach each env exactly as ``SyncVectorEnv`` hands them (value and dtype).
- The same misuse raises the same exception type as Gymnasium's ``AsyncVectorEnv`` (the table
  below was written from what Gymnasium 1.x raises, and a test keeps it true).
- Ids registered only in the caller's process build in spawned and forkserver workers.
- An env whose observation does not fit its space fails as that env, like any env failure.
"""

from __future__ import annotations

import functools
import math
import random
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import gymnasium
import gymnasium.wrappers.vector
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

import envfleet
from tests.test_equivalence import MODES, assert_same

# The oracle, Gymnasium's AsyncVectorEnv, logs each env error it re-raises as a UserWarning
# with the worker's traceback: expected here, and noise in the test log.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:gymnasium.vector.async_vector_env")

STEPS = 30
SEED = 3

# Envs that differ in dynamics (gravity, reward) and in episode length, so autoresets fall on
# different steps for different envs.
PENDULUM_FNS = [
    functools.partial(gymnasium.make, "Pendulum-v1", g=g, max_episode_steps=m)
    for g, m in ((9.81, 7), (2.0, 5), (15.0, 9), (0.5, 6), (9.81, 4))
]
CARTPOLE_FNS = [
    functools.partial(gymnasium.make, "CartPole-v1", sutton_barto_reward=sb, max_episode_steps=m)
    for sb, m in ((False, 8), (True, 5), (False, 11), (True, 6), (False, 500))
]
HETERO = {"Pendulum": PENDULUM_FNS, "CartPole": CARTPOLE_FNS}
CONFIGS = [("serial", None), ("thread", 2), ("process", 2)]
CONFIG_IDS = ["serial", "thread-w2", "process-w2"]


def actions_for(space: gymnasium.Space[Any], n: int, steps: int) -> list[np.ndarray]:
    """Seeded actions: float64 for a Box (not the space's float32, as numpy code makes them)."""
    rng = np.random.default_rng(SEED)
    if isinstance(space, spaces.Box):
        return [rng.uniform(-2.0, 2.0, size=(n, *space.shape)) for _ in range(steps)]
    assert isinstance(space, spaces.Discrete)
    return [rng.integers(0, int(space.n), size=n) for _ in range(steps)]


def sync_drive(venv: Any, env_fns: list[Any], mode: AutoresetMode) -> Iterator[tuple[str, Any]]:
    """Reset with ``SEED``, step with float64 (or int) actions; DISABLED resets ended envs."""
    yield "reset", venv.reset(seed=SEED)
    for t, actions in enumerate(actions_for(venv.single_action_space, len(env_fns), STEPS)):
        result = venv.step(actions)
        yield f"step {t}", result
        ended = result[2] | result[3]
        if mode is AutoresetMode.DISABLED and ended.any():
            yield f"reset after {t}", venv.reset(options={"reset_mask": ended.copy()})


@functools.cache
def reference(case: str, mode: AutoresetMode) -> list[tuple[str, Any]]:
    with closing(SyncVectorEnv(HETERO[case], autoreset_mode=mode)) as venv:
        return list(sync_drive(venv, HETERO[case], mode))


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("case", list(HETERO))
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_env_fns_match_sync_vector_env(
    case: str, mode: AutoresetMode, config: tuple[str, int | None]
) -> None:
    backend, workers = config
    env_fns = HETERO[case]
    expected = reference(case, mode)
    with envfleet.make(env_fns, backend=backend, num_workers=workers, autoreset_mode=mode) as pool:
        assert pool.num_envs == len(env_fns)
        got = list(sync_drive(pool, env_fns, mode))
    assert [what for what, _ in got] == [what for what, _ in expected]
    for (what, want), (_, result) in zip(expected, got, strict=True):
        assert_same(want, result, f"{case}/{mode.name}/{backend} {what}")
    ended = sum(int((r[2] | r[3]).sum()) for what, r in expected if what.startswith("step"))
    assert ended >= 10, "too few episodes ended for autoreset to be exercised"


def per_env_reference(case: str, mode: AutoresetMode) -> dict[int, list[tuple[Any, ...]]]:
    """Each env's own sequence of results under ``SyncVectorEnv`` (obs, reward, flags)."""
    records: dict[int, list[tuple[Any, ...]]] = {i: [] for i in range(len(HETERO[case]))}
    ended: set[int] = set()
    for what, result in reference(case, mode):
        if what == "reset":
            for i in records:
                records[i].append(("reset", result[0][i].tobytes()))
        elif what.startswith("reset after"):  # DISABLED: only the envs that ended were reset
            for i in sorted(ended):
                records[i].append(("reset", result[0][i].tobytes()))
        else:
            obs, rewards, terms, truncs, _ = result
            ended = set(np.flatnonzero(terms | truncs).tolist())
            for i in records:
                records[i].append(
                    ("step", obs[i].tobytes(), rewards[i], bool(terms[i]), bool(truncs[i]))
                )
    return records


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
@pytest.mark.parametrize("config", CONFIGS[1:], ids=CONFIG_IDS[1:])
def test_env_fns_async_batches_match_sync_vector_env_per_env(
    mode: AutoresetMode, config: tuple[str, int | None]
) -> None:
    """``batch_size=2`` of 5: envs come back in any order, each env's own trajectory (with its
    own actions, float64) is the one ``SyncVectorEnv`` gives it. Under DISABLED an env that
    ended is reset on its own (``async_reset(env_id=[i])``) before its next action."""
    backend, workers = config
    with envfleet.make(
        HETERO["Pendulum"], backend=backend, num_workers=workers, batch_size=2, autoreset_mode=mode
    ) as pool:
        check_async_batches_per_env(pool, mode)


def check_async_batches_per_env(pool: envfleet.Pool, mode: AutoresetMode) -> None:
    """The body of :func:`test_env_fns_async_batches_match_sync_vector_env_per_env`, on a pool
    of ``HETERO["Pendulum"]`` made in ``mode`` (any ``batch_size``: batches of 2 are asked)."""
    case = "Pendulum"
    n = len(HETERO[case])
    expected = per_env_reference(case, mode)
    actions = actions_for(spaces.Box(-2, 2, (1,)), n, STEPS)
    got: dict[int, list[tuple[Any, ...]]] = {i: [] for i in range(n)}
    pool.async_reset(seed=SEED)
    sent = dict.fromkeys(range(n), 0)  # actions each env has been sent
    resetting: dict[int, bool] = {}  # DISABLED: envs whose reset is in flight
    in_flight = set(range(n))
    while in_flight:
        # Fewer than a batch left in flight at the end: collect them in a smaller batch.
        pool.batch_size = min(2, len(in_flight))
        obs, rewards, terms, truncs, infos = pool.recv()
        for k, i in enumerate(infos["env_id"].tolist()):
            in_flight.discard(i)
            if not got[i] or resetting.pop(i, False):
                got[i].append(("reset", obs[k].tobytes()))
            else:
                got[i].append(
                    ("step", obs[k].tobytes(), rewards[k], bool(terms[k]), bool(truncs[k]))
                )
                ended = bool(terms[k] or truncs[k])
                if mode is AutoresetMode.DISABLED and ended:
                    pool.async_reset(env_id=[i])
                    resetting[i] = True
                    in_flight.add(i)
                    continue
            if sent[i] < STEPS:
                pool.send(actions[sent[i]][i : i + 1], [i])
                sent[i] += 1
                in_flight.add(i)
    for i in range(n):
        assert len(got[i]) == len(expected[i]), f"env {i}: {len(got[i])} results"
        assert got[i] == expected[i], f"env {i} differs from SyncVectorEnv's"


# -- actions reach the env as SyncVectorEnv hands them ---------------------------------------


class ActionEcho(gymnasium.Env[np.ndarray, np.ndarray]):
    """Keeps the last action it was given (``last``) to compare with what was sent."""

    def __init__(self, dtype: str = "uint8") -> None:
        kind = np.dtype(dtype)
        high = 255 if kind.kind in "iu" else 1.0
        self.action_space = spaces.Box(0, high, shape=(2,), dtype=kind)  # type: ignore[arg-type]
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)
        self.last: Any = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(2), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.last = np.array(action, copy=True)
        return np.asarray(action, np.float64), 0.0, False, False, {}


ACTIONS = {
    # An int64 action outside uint8's range: cast into a uint8 row, 1000 would arrive as 232.
    "uint8 box, int64 1000 and -1": ("uint8", np.array([[1000, -1], [3, 4], [255, 0]])),
    "uint8 box, uint8 actions": ("uint8", np.array([[1, 2], [3, 4], [255, 0]], np.uint8)),
    # float64 actions for a float32 Box: cast to float32 they would lose their low bits.
    "float32 box, float64 actions": ("float32", np.random.default_rng(0).uniform(size=(3, 2))),
    "float32 box, float32 actions": ("float32", np.full((3, 2), 0.1, np.float32)),
}


@pytest.mark.parametrize(("dtype", "actions"), list(ACTIONS.values()), ids=list(ACTIONS))
def test_actions_reach_the_env_as_sync_vector_env_hands_them(
    backend: str, dtype: str, actions: np.ndarray
) -> None:
    factory = functools.partial(ActionEcho, dtype)
    with (
        closing(SyncVectorEnv([factory] * 3)) as sync,
        envfleet.make(factory, 3, backend=backend, num_workers=2) as pool,
    ):
        sync.reset(seed=0)
        pool.reset(seed=0)
        want = sync.step(actions)
        got = pool.step(actions)
        assert_same(want, got)
        expected = sync.get_attr("last")
        assert_same(expected, pool.get_attr("last"))
        assert pool.get_attr("last")[0].dtype == actions.dtype


class KeepAction(gymnasium.Env[np.ndarray, Any]):
    """Keeps the last action exactly as given (``last``: no copy, no conversion)."""

    def __init__(self, action_space: spaces.Space[Any]) -> None:
        self.action_space = action_space
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
        self.last: Any = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.last = action
        return np.zeros(1, np.float32), 0.0, False, False, {}


DISCRETE_ACTIONS = {
    "Discrete": (spaces.Discrete(3), np.array([2, 0, 1])),
    "Dict of Discrete and Box": (
        spaces.Dict({"k": spaces.Discrete(3), "x": spaces.Box(-1, 1, (2,), np.float32)}),
        {"k": np.array([2, 0, 1]), "x": np.full((3, 2), 0.5, np.float32)},
    ),
}


@pytest.mark.parametrize(
    ("space", "actions"), list(DISCRETE_ACTIONS.values()), ids=list(DISCRETE_ACTIONS)
)
def test_discrete_actions_reach_the_env_as_numpy_integers(
    backend: str, space: spaces.Space[Any], actions: Any
) -> None:
    """``SyncVectorEnv`` hands a ``Discrete`` env ``np.int64`` from a numpy batch (an env may
    call ``action.item()``), not a Python ``int``."""
    factory = functools.partial(KeepAction, space)
    with (
        closing(SyncVectorEnv([factory] * 3)) as sync,
        envfleet.make(factory, 3, backend=backend, num_workers=2) as pool,
    ):
        sync.reset(seed=0)
        pool.reset(seed=0)
        sync.step(actions)
        pool.step(actions)
        expected = sync.get_attr("last")
        assert_same(expected, pool.get_attr("last"))
        first = expected[0]["k"] if isinstance(space, spaces.Dict) else expected[0]
        assert type(first) is np.int64  # the oracle's own type, so this test can fail


class SmoothAction(gymnasium.Env[np.ndarray, np.ndarray]):
    """Penalises the change of action: keeps the previous action as it was handed (no copy)."""

    def __init__(self, action_space: spaces.Space[Any]) -> None:
        self.action_space = action_space
        self.observation_space = spaces.Box(-10.0, 10.0, shape=(2,), dtype=np.float32)
        self.previous: Any = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.previous = None
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        change = 0.0 if self.previous is None else np.abs(action - self.previous).sum()
        self.previous = action
        return np.asarray(action, np.float32), -float(change), False, False, {}


@pytest.mark.parametrize(
    "space",
    [spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32), spaces.MultiDiscrete([3, 3])],
    ids=["Box", "MultiDiscrete"],
)
def test_an_action_the_env_keeps_is_not_overwritten_by_the_next(
    backend: str, space: spaces.Space[Any]
) -> None:
    """Each env gets its own action, as ``SyncVectorEnv`` hands it a row of the caller's batch:
    not a view of the pool's action memory, which the next step overwrites."""
    space.seed(0)
    batch = batch_space(space, 3)
    actions = [batch.sample() for _ in range(4)]
    factory = functools.partial(SmoothAction, space)
    with (
        closing(SyncVectorEnv([factory] * 3)) as sync,
        envfleet.make(factory, 3, backend=backend, num_workers=2) as pool,
    ):
        sync.reset(seed=0)
        pool.reset(seed=0)
        for action in actions:
            want, got = sync.step(action), pool.step(action)
            assert_same(want, got)
        assert want[1].any()  # the penalty is not 0: the oracle really saw a change


def test_actions_outside_the_space_reach_the_env_unless_check_actions(backend: str) -> None:
    """As in Gymnasium, an action outside the space is the env's business (it may accept it);
    ``check_actions=True`` refuses it before anything is sent."""
    with envfleet.make(functools.partial(ActionEcho, "float32"), 2, backend=backend) as pool:
        pool.reset(seed=0)
        pool.step(np.array([[5.0, -3.0], [0.5, 0.5]], np.float32))
        np.testing.assert_array_equal(pool.get_attr("last")[0], [5.0, -3.0])
    with envfleet.make("CartPole-v1", 2, backend=backend, check_actions=True) as pool:
        pool.reset(seed=0)
        with pytest.raises(ValueError, match="action 7 for env 1 is outside"):
            pool.step(np.array([0, 7]))
        pool.step(np.array([0, 1]))  # the refused step changed nothing


class NoContainsSpace(spaces.Space[Any]):
    """A custom space whose ``contains`` raises on every value."""

    def contains(self, x: Any) -> bool:
        raise TypeError("unhashable nonsense")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoContainsSpace)

    __hash__ = spaces.Space.__hash__

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        return 0


class CustomActionEnv(gymnasium.Env[np.ndarray, Any]):
    def __init__(self) -> None:
        self.action_space = NoContainsSpace()
        self.observation_space = spaces.Box(-1, 1, shape=(1,), dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.full(1, 0.5, np.float32), float(action), False, False, {}


def test_a_space_whose_contains_raises_is_not_a_bare_type_error() -> None:
    with envfleet.make(CustomActionEnv, 2, backend="serial") as pool:
        pool.reset(seed=0)
        _, rewards, _, _, _ = pool.step([1, 2])  # not checked by default: the env takes them
        np.testing.assert_array_equal(rewards, [1.0, 2.0])
    with envfleet.make(CustomActionEnv, 2, backend="serial", check_actions=True) as pool:
        pool.reset(seed=0)
        with pytest.raises(ValueError, match=r"env 0 could not be checked.*TypeError"):
            pool.step([1, 2])


# -- the same exception types as Gymnasium's AsyncVectorEnv -----------------------------------

Misuse = Callable[[Any], Any]

MISUSES: dict[str, tuple[Misuse, type[BaseException]]] = {
    # Written from Gymnasium 1.x's AsyncVectorEnv (test_gymnasium_raises_the_same keeps it true).
    "too many actions": (lambda v: v.step(np.array([0, 1, 0])), ValueError),
    "too few actions": (lambda v: v.step(np.array([0])), ValueError),
    "too many actions, list": (lambda v: v.step([0, 1, 0]), ValueError),
    "scalar action": (lambda v: v.step(0), TypeError),
    "numpy scalar action": (lambda v: v.step(np.int64(1)), TypeError),
    "reset_mask a list": (lambda v: v.reset(options={"reset_mask": [True, False]}), TypeError),
    "reset_mask shape": (lambda v: v.reset(options={"reset_mask": np.ones(3, bool)}), ValueError),
    "reset_mask dtype": (lambda v: v.reset(options={"reset_mask": np.ones(2, int)}), TypeError),
    "reset_mask empty": (lambda v: v.reset(options={"reset_mask": np.zeros(2, bool)}), ValueError),
    "seeds per env": (lambda v: v.reset(seed=[1, 2, 3]), ValueError),
    "negative seed": (lambda v: v.reset(seed=-1), gymnasium.error.Error),
    "negative seed in a list": (lambda v: v.reset(seed=[0, -1]), gymnasium.error.Error),
    "seed not an int": (lambda v: v.reset(seed=[0, "1"]), gymnasium.error.Error),
}
CLOSED: dict[str, Misuse] = {
    "step": lambda v: v.step(np.array([0, 1])),
    "reset": lambda v: v.reset(),
    "call": lambda v: v.call("render"),
}
CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
MOUNTAIN_CAR = functools.partial(gymnasium.make, "MountainCar-v0")


@pytest.mark.parametrize(("misuse", "error"), list(MISUSES.values()), ids=list(MISUSES))
def test_gymnasium_raises_the_same(misuse: Misuse, error: type[BaseException]) -> None:
    # A fresh one each: after some of these, Gymnasium's AsyncVectorEnv is broken.
    with closing(AsyncVectorEnv([CARTPOLE] * 2, context="fork")) as venv:
        venv.reset(seed=0)
        with pytest.raises(error):
            misuse(venv)


@pytest.mark.parametrize(("misuse", "error"), list(MISUSES.values()), ids=list(MISUSES))
def test_misuse_raises_gymnasium_exception_types(
    backend: str, misuse: Misuse, error: type[BaseException]
) -> None:
    with envfleet.make([CARTPOLE] * 2, backend=backend) as pool:
        pool.reset(seed=0)
        with pytest.raises(error):
            misuse(pool)
        pool.step(np.array([0, 1]))  # refused before anything was sent: the pool still works


DICT_ACTIONS = functools.partial(KeepAction, DISCRETE_ACTIONS["Dict of Discrete and Box"][0])
DICT_MISUSES: dict[str, tuple[Misuse, type[BaseException]]] = {
    # A Dict action space: the batch checked key by key, as Gymnasium's iterate does.
    "missing key": (lambda v: v.step({"k": np.array([0, 1])}), KeyError),
    "too many": (
        lambda v: v.step({"k": np.array([0, 1, 2]), "x": np.zeros((3, 2), np.float32)}),
        ValueError,
    ),
    "scalar": (lambda v: v.step(0), TypeError),
}
TUPLE_ACTIONS = functools.partial(
    KeepAction, spaces.Tuple((spaces.Discrete(2), spaces.Box(-1, 1, (2,), np.float32)))
)
TUPLE_MISUSES: dict[str, tuple[Misuse, type[BaseException]]] = {
    "missing part": (lambda v: v.step((np.array([0, 1]),)), IndexError),
    "too many": (lambda v: v.step((np.array([0, 1, 1]), np.zeros((3, 2), np.float32))), ValueError),
    "scalar": (lambda v: v.step(1), TypeError),
}


COMPOSITE_MISUSES = {
    **{f"Dict, {name}": (DICT_ACTIONS, *case) for name, case in DICT_MISUSES.items()},
    **{f"Tuple, {name}": (TUPLE_ACTIONS, *case) for name, case in TUPLE_MISUSES.items()},
}


@pytest.mark.parametrize(
    ("factory", "misuse", "error"), list(COMPOSITE_MISUSES.values()), ids=list(COMPOSITE_MISUSES)
)
def test_composite_action_misuse_raises_what_gymnasium_raises(
    factory: Callable[[], gymnasium.Env[Any, Any]], misuse: Misuse, error: type[BaseException]
) -> None:
    with closing(AsyncVectorEnv([factory] * 2, context="fork")) as venv:
        venv.reset(seed=0)
        with pytest.raises(error):
            misuse(venv)
    with envfleet.make([factory] * 2, backend="serial") as pool:
        pool.reset(seed=0)
        with pytest.raises(error):
            misuse(pool)
        pool.step(pool.action_space.sample())  # refused before anything was sent


ENV_MISUSES: dict[str, tuple[Misuse, bool, type[BaseException]]] = {
    # The env itself refuses: AsyncVectorEnv re-raises the env's own exception type.
    # (misuse, reset first, what Gymnasium raises)
    "get_attr of a missing attribute": (lambda v: v.get_attr("no_such_attr"), True, AttributeError),
    "float actions for Discrete": (lambda v: v.step(np.array([0.0, 1.0])), True, AssertionError),
}


def test_step_before_reset_raises_reset_needed_as_gymnasium_does(backend: str) -> None:
    """Gymnasium's env raises ResetNeeded in its worker; the pool refuses before sending (the
    same type, and the pool stays usable: ``test_api.test_step_before_reset_is_refused``)."""
    with (
        closing(AsyncVectorEnv([CARTPOLE] * 2, context="fork")) as venv,
        pytest.raises(gymnasium.error.ResetNeeded),
    ):
        venv.step(np.array([0, 1]))
    with envfleet.make([CARTPOLE] * 2, backend=backend) as pool:
        with pytest.raises(gymnasium.error.ResetNeeded):
            pool.step(np.array([0, 1]))
        pool.reset(seed=0)
        pool.step(np.array([0, 1]))


@pytest.mark.parametrize(
    ("misuse", "reset", "error"), list(ENV_MISUSES.values()), ids=list(ENV_MISUSES)
)
def test_env_errors_are_also_of_the_envs_own_type(
    backend: str, misuse: Misuse, reset: bool, error: type[BaseException]
) -> None:
    """An ``except`` written for Gymnasium (which re-raises the env's exception type) catches
    envfleet's ``EnvError`` too: it is an instance of both."""
    with closing(AsyncVectorEnv([CARTPOLE] * 2, context="fork")) as venv:
        if reset:
            venv.reset(seed=0)
        with pytest.raises(error):
            misuse(venv)
    with envfleet.make([CARTPOLE] * 2, backend=backend) as pool:
        if reset:
            pool.reset(seed=0)
        with pytest.raises(error) as raised:
            misuse(pool)
    assert isinstance(raised.value, envfleet.EnvError)
    assert type(raised.value.__cause__) is error
    assert raised.value.env_index in (0, 1)
    with pytest.raises(TypeError):  # a factory that raises when the pool builds its envs
        AsyncVectorEnv([functools.partial(gymnasium.make, "CartPole-v1", nope=1)] * 2)
    with pytest.raises(TypeError) as made:
        envfleet.make([functools.partial(gymnasium.make, "CartPole-v1", nope=1)] * 2)
    assert isinstance(made.value, envfleet.EnvError)
    assert made.value.phase is envfleet.Phase.MAKE


@pytest.mark.parametrize("misuse", list(CLOSED.values()), ids=list(CLOSED))
def test_use_after_close_is_closed_environment_error(backend: str, misuse: Misuse) -> None:
    pool = envfleet.make([CARTPOLE] * 2, backend=backend)
    pool.close()
    with pytest.raises(ClosedEnvironmentError):
        misuse(pool)
    with pytest.raises(envfleet.ClosedPoolError):
        misuse(pool)
    venv = AsyncVectorEnv([CARTPOLE] * 2, context="fork")
    venv.close()
    with pytest.raises(ClosedEnvironmentError):
        misuse(venv)


def async_vector_env_calls(venv: Any) -> list[Any]:
    """Gymnasium's step_async/step_wait, reset_async/reset_wait and call_async/call_wait, as
    code written for ``AsyncVectorEnv`` calls them."""
    venv.reset_async(seed=4)
    results: list[Any] = [venv.reset_wait()]
    for t in range(12):
        venv.step_async(np.array([t % 2, 1, 0]))
        results.append(venv.step_wait())
    venv.reset_async(options={"reset_mask": np.array([False, True, False])})
    results.append(venv.reset_wait(timeout=5.0))
    venv.call_async("get_wrapper_attr", "_elapsed_steps")
    results.append(venv.call_wait(timeout=5.0))
    venv.call_async("_max_episode_steps")  # an attribute
    results.append(venv.call_wait())
    return results


ASYNC_MISUSES: dict[str, Misuse] = {
    "step_wait first": lambda v: v.step_wait(),
    "reset_wait first": lambda v: v.reset_wait(),
    "step_async twice": lambda v: (v.step_async(np.zeros(3, np.int64)), v.step_async([0, 0, 0])),
    "step_wait after reset_async": lambda v: (v.reset_async(), v.step_wait()),
    "reset_async after step_async": lambda v: (
        v.step_async(np.zeros(3, np.int64)),
        v.reset_async(),
    ),
    "call_wait after step_async": lambda v: (v.step_async(np.zeros(3, np.int64)), v.call_wait()),
    "step_async after call_async": lambda v: (v.call_async("render"), v.step_async([0, 0, 0])),
    "reset_async with a float seed": lambda v: v.reset_async(seed=1.5),
    "reset_wait after a refused reset_async": lambda v: (
        _refused(v.reset_async, 5),
        v.reset_wait(),
    ),
}
ASYNC_ERRORS = {
    "step_wait first": NoAsyncCallError,
    "reset_wait first": NoAsyncCallError,
    "step_async twice": AlreadyPendingCallError,
    "step_wait after reset_async": NoAsyncCallError,
    "reset_async after step_async": AlreadyPendingCallError,
    "call_wait after step_async": NoAsyncCallError,
    "step_async after call_async": AlreadyPendingCallError,
    "reset_async with a float seed": TypeError,
    "reset_wait after a refused reset_async": NoAsyncCallError,
}


def _refused(call: Callable[..., Any], options: Any) -> None:
    """``call(options=options)`` raises TypeError at once (and so leaves nothing pending)."""
    with pytest.raises(TypeError):
        call(options=options)


def test_step_async_and_step_wait_are_async_vector_envs(backend: str) -> None:
    env_fns = CARTPOLE_FNS[:3]  # episodes of 8, 5 and 11 steps: autoresets within the run
    with closing(AsyncVectorEnv(env_fns, context="fork")) as venv:
        want = async_vector_env_calls(venv)
    with envfleet.make(env_fns, backend=backend) as pool:
        assert_same(want, async_vector_env_calls(pool))
    for name, misuse in ASYNC_MISUSES.items():
        # A fresh one each: a misuse can leave AsyncVectorEnv waiting.
        with closing(AsyncVectorEnv(env_fns, context="fork")) as venv:
            venv.reset(seed=0)
            with pytest.raises(ASYNC_ERRORS[name]):
                misuse(venv)
        with envfleet.make(env_fns, backend=backend) as pool:
            pool.reset(seed=0)
            with pytest.raises(ASYNC_ERRORS[name]):
                misuse(pool)


def test_close_takes_gymnasiums_arguments(backend: str) -> None:
    """``close(timeout=None, terminate=True)`` as written for AsyncVectorEnv: the pool closes
    (within its own bound; the leak check after each test sees no worker left)."""
    pool = envfleet.make([CARTPOLE] * 2, backend=backend)
    pool.reset(seed=0)
    with pytest.raises(TypeError, match="timeout must be"):
        pool.close(timeout="soon")  # type: ignore[arg-type]
    for endless in (math.inf, math.nan):  # nan left the process backend's workers running
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            pool.close(timeout=endless)
    assert not pool.closed  # refused before anything was stopped
    pool.close(timeout=None, terminate=True)
    assert pool.closed
    with pytest.raises(ClosedEnvironmentError):
        pool.step(np.array([0, 1]))


def wrapped_for_training(venv: Any) -> Any:
    """Gymnasium's vector wrappers as training code stacks them on a vector env (CleanRL's
    ppo_continuous.py puts their single-env twins inside each env)."""
    vw = gymnasium.wrappers.vector
    venv = vw.ClipAction(vw.RecordEpisodeStatistics(venv))
    return vw.DictInfoToList(vw.NormalizeReward(vw.NormalizeObservation(venv)))


def without_episode_times(record: tuple[str, Any]) -> tuple[str, Any]:
    """The record with each ``info["episode"]["t"]`` (wall-clock seconds) taken out."""
    for info in record[1][-1]:
        info.get("episode", {}).pop("t", None)
    return record


def test_gymnasium_vector_wrappers_on_a_pool_match_sync_vector_env(backend: str) -> None:
    """Gymnasium's vector wrappers on a pool (normalised observations and rewards, clipped
    float64 actions, episode statistics, infos as a list) give what they give on
    SyncVectorEnv, bit for bit (but the episodes' wall-clock times)."""
    mode = AutoresetMode.NEXT_STEP
    with closing(wrapped_for_training(SyncVectorEnv(PENDULUM_FNS))) as venv:
        want = [without_episode_times(r) for r in sync_drive(venv, PENDULUM_FNS, mode)]
    with closing(wrapped_for_training(envfleet.make(PENDULUM_FNS, backend=backend))) as envs:
        got = [without_episode_times(r) for r in sync_drive(envs, PENDULUM_FNS, mode)]
    assert sum("episode" in info for _, result in want for info in result[-1]) > 5
    assert_same(want, got)


def test_a_masked_reset_leaves_the_callers_options_so_episode_statistics_stay_right() -> None:
    """Under DISABLED, Gymnasium's vector ``RecordEpisodeStatistics`` reads ``reset_mask`` after
    the reset to restart those envs' counts. SyncVectorEnv pops it from the caller's dict, so
    there the wrapper restarts every env's counts (a documented difference): the pool leaves the
    dict as given, and the episode lengths it reports are the envs' own."""
    env_fns = CARTPOLE_FNS[:3]  # time limits of 8, 5 and 11 steps
    lengths = {}
    for name, venv in (
        ("sync", SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.DISABLED)),
        ("pool", envfleet.make(env_fns, backend="serial", autoreset_mode="disabled")),
    ):
        with closing(gymnasium.wrappers.vector.RecordEpisodeStatistics(venv)) as envs:
            envs.reset(seed=0)
            steps, reported = np.zeros(3, np.int64), []
            for _ in range(12):
                _, _, terminated, truncated, infos = envs.step(np.zeros(3, np.int64))
                steps += 1
                ended = terminated | truncated
                if ended.any():
                    reported.append((infos["episode"]["l"][ended].tolist(), steps[ended].tolist()))
                    envs.reset(options={"reset_mask": ended})
                    steps[ended] = 0
            lengths[name] = reported
            if name == "pool":
                options = {"reset_mask": np.array([True, False, False])}
                envs.env.reset(options=options)
                assert "reset_mask" in options
    assert all(got == true for got, true in lengths["pool"])
    assert any(got != true for got, true in lengths["sync"])  # Gymnasium's count restarted


def test_a_pool_of_gymnasium_make_partials_is_named_by_its_id() -> None:
    """``functools.partial(gymnasium.make, id)`` factories (Gymnasium's own ``make_vec``
    pattern) name the pool in its repr and messages by the id, not as ``make``."""
    pool = envfleet.make([CARTPOLE] * 2, backend="serial")
    assert repr(pool).startswith("Pool(CartPole-v1, num_envs=2")
    pool.close()
    with pytest.raises(ClosedEnvironmentError, match="pool of CartPole-v1 is closed"):
        pool.reset()


def randomised_pendulum() -> gymnasium.Env[Any, Any]:
    """A factory that draws its dynamics from the global RNGs (Gymnasium's A2C tutorial's
    domain randomisation)."""
    return gymnasium.make("Pendulum-v1", g=float(np.random.normal(10.0, 1.0)) + random.random())


def test_factories_that_draw_from_the_global_rngs_draw_what_they_draw_in_sync_vector_env() -> None:
    """The env make() builds to learn the spaces is not env 0: the global RNGs it drew from are
    put back, so env i gets SyncVectorEnv's env i's draws, and the caller's next draws match
    (serial: the envs are built in the caller's thread, in order, as SyncVectorEnv builds them)."""
    drawn = []
    for build in (SyncVectorEnv, functools.partial(envfleet.make, backend="serial")):
        np.random.seed(0)
        random.seed(0)
        with closing(build([randomised_pendulum] * 3)) as venv:
            drawn.append((venv.get_attr("g"), np.random.random(), random.random()))
    assert drawn[0] == drawn[1]
    assert len(set(drawn[0][0])) == 3


NEVER_CLOSED = """
import functools, gymnasium, envfleet
envs = envfleet.make([functools.partial(gymnasium.make, "CartPole-v1")] * 2, backend="serial")
envs.reset(seed=0)
print("done", flush=True)
"""


def test_a_serial_pool_never_closed_lets_the_interpreter_exit() -> None:
    """A script that never calls ``close()`` (fine with SyncVectorEnv) ends: the pool collected
    at interpreter exit closes its envs in place (a closer thread started then never ran, and
    Python 3.11 waited for it for ever)."""
    result = subprocess.run(
        [sys.executable, "-c", NEVER_CLOSED],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "done\n"), result.stderr[-2000:]


@pytest.mark.parametrize("other", ["observation", "action"])
def test_incompatible_spaces_raise_runtime_error_naming_the_env(backend: str, other: str) -> None:
    """Gymnasium raises RuntimeError; envfleet's EnvError is one, naming the env and space."""
    first: Any = CARTPOLE
    second: Any = MOUNTAIN_CAR
    if other == "action":  # the same observation space, another action space
        first = functools.partial(ActionEcho, "uint8")
        second = functools.partial(ActionEcho, "float32")
    with pytest.raises(RuntimeError):
        SyncVectorEnv([first, second])
    with pytest.raises(RuntimeError):  # AsyncVectorEnv's _check_spaces
        AsyncVectorEnv([first, second], context="fork")
    with pytest.raises(RuntimeError, match=rf"env 1 .*has {other} space") as raised:
        envfleet.make([first, second], backend=backend, num_workers=2)
    assert isinstance(raised.value, envfleet.EnvError)
    assert raised.value.phase is envfleet.Phase.MAKE


def test_num_envs_must_match_the_env_fns() -> None:
    with pytest.raises(ValueError, match=r"num_envs=3 but 2 envs were given"):
        envfleet.make([CARTPOLE] * 2, 3, backend="serial")
    with pytest.raises(ValueError, match=r"env_kwargs has 3 entries for 2 envs"):
        envfleet.make([CARTPOLE] * 2, backend="serial", env_kwargs=[{}, {}, {}])
    with pytest.raises(TypeError, match="needs num_envs"):
        envfleet.make("CartPole-v1", backend="serial")
    # One factory in a list is one env, as AsyncVectorEnv([make_env]) is (--num-envs 1).
    with pytest.raises(ValueError, match=r"num_envs=2 but 1 envs were given"):
        envfleet.make([CARTPOLE], 2, backend="serial")
    with pytest.raises(ValueError, match=r"num_envs=2 but 1 envs were given"):
        envfleet.make("CartPole-v1", 2, backend="serial", env_kwargs=[{}])
    for one in ([CARTPOLE], ["CartPole-v1"]):
        with envfleet.make(one, backend="serial") as pool:
            assert pool.num_envs == 1
    with envfleet.make("Pendulum-v1", backend="serial", env_kwargs=[{"g": 3.0}]) as pool:
        assert pool.get_attr("g") == (3.0,)


def test_ids_and_per_env_kwargs(backend: str) -> None:
    """A list of ids, and ``env_kwargs`` as one mapping per env, build env i with entry i."""
    with envfleet.make(
        "Pendulum-v1", env_kwargs=[{"g": 1.0}, {"g": 2.0}, {"g": 3.0}], backend=backend
    ) as pool:
        assert pool.get_attr("g") == (1.0, 2.0, 3.0)
    with envfleet.make(["CartPole-v1", "CartPole-v1"], backend=backend, seed=1) as pool:
        obs, _ = pool.reset()
    with closing(SyncVectorEnv([CARTPOLE] * 2)) as sync:
        assert_same(sync.reset(seed=1)[0], obs)


def test_np_random_seed_is_per_env_as_in_gymnasium(backend: str) -> None:
    with (
        closing(SyncVectorEnv([CARTPOLE] * 3)) as sync,
        envfleet.make([CARTPOLE] * 3, backend=backend, num_workers=2) as pool,
    ):
        sync.reset(seed=11)
        pool.reset(seed=11)
        assert pool.np_random_seed == sync.np_random_seed == (11, 12, 13)
        draws = [rng.integers(1 << 30) for rng in pool.np_random]
        assert draws == [rng.integers(1 << 30) for rng in sync.np_random]


# -- restarts rebuild env i with env_fns[i] --------------------------------------------------


def crash_on_first_step(fail: bool, episode_length: int) -> gymnasium.Env[Any, Any]:
    from tests.envs import FaultyEnv

    def hook(env: FaultyEnv, action: Any) -> None:
        if fail and not getattr(env, "failed", False):
            env.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("boom")

    return FaultyEnv(step_hook=hook, episode_length=episode_length)


def test_a_restart_rebuilds_env_i_with_its_own_factory(backend: str) -> None:
    env_fns = [
        functools.partial(crash_on_first_step, fail=i == 1, episode_length=3 + i) for i in range(3)
    ]
    with envfleet.make(env_fns, backend=backend, on_error="restart", num_workers=2) as pool:
        pool.reset(seed=0)
        _, _, _, truncs, _infos = pool.step(np.zeros(3, np.int64))
        assert truncs.tolist() == [False, True, False]
        assert pool.restarts.tolist() == [0, 1, 0]
        assert pool.get_attr("episode_length") == (3, 4, 5)  # env 1 is env_fns[1]'s again


# -- registered ids in workers that do not inherit the registry -------------------------------

REGISTERED = "envfleet-test/RegisteredOnlyHere-v0"


@pytest.fixture
def registered_id() -> Iterator[str]:
    gymnasium.register(REGISTERED, entry_point="tests.envs:DictTupleEnv", kwargs={"max_steps": 4})
    yield REGISTERED
    gymnasium.registry.pop(REGISTERED, None)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_an_id_registered_in_the_caller_builds_in_fresh_workers(
    registered_id: str, context: str
) -> None:
    with (
        envfleet.make(registered_id, 2, backend="process", num_workers=2, context=context) as pool,
        closing(SyncVectorEnv([functools.partial(gymnasium.make, registered_id)] * 2)) as sync,
    ):
        assert_same(sync.reset(seed=5), pool.reset(seed=5))
        actions = np.full((2, 2), 0.25, np.float32)
        assert_same(sync.step(actions), pool.step(actions))
        assert pool.get_attr("max_steps") == (4, 4)


@pytest.fixture
def overridden_cartpole() -> Iterator[str]:
    """``CartPole-v1`` registered anew in this process (other kwargs and time limit), as a user
    may do over a built-in id; a fresh worker's registry still has the built-in entry."""
    original = gymnasium.registry["CartPole-v1"]
    with pytest.warns(UserWarning, match="Overriding"):
        gymnasium.register(
            "CartPole-v1",
            entry_point=original.entry_point,
            max_episode_steps=7,
            kwargs={"sutton_barto_reward": True},
        )
    yield "CartPole-v1"
    gymnasium.registry["CartPole-v1"] = original


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_the_callers_entry_wins_over_a_fresh_workers_registry(
    overridden_cartpole: str, context: str
) -> None:
    with (
        envfleet.make(overridden_cartpole, 2, num_workers=2, context=context) as pool,
        closing(
            SyncVectorEnv([functools.partial(gymnasium.make, overridden_cartpole)] * 2)
        ) as sync,
    ):
        assert pool.get_attr("_sutton_barto_reward") == (True, True)
        assert_same(sync.reset(seed=2), pool.reset(seed=2))
        for _ in range(8):  # past the caller's time limit of 7 steps
            assert_same(sync.step(np.array([0, 1])), pool.step(np.array([0, 1])))


def test_an_entry_point_a_fresh_worker_cannot_import_says_why_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The id's entry point lives in a module that only this process has (made at run time):
    a spawned worker cannot import it, and the error says so, naming the remedies."""
    module = types.ModuleType("envfleet_test_only_here")
    module.Env = BadObservationEnv  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    env_id = "envfleet-test/OnlyHere-v0"
    gymnasium.register(
        env_id, entry_point=f"{module.__name__}:Env", kwargs={"bad": False, "observation": None}
    )
    try:
        with envfleet.make(env_id, 2, backend="serial") as pool:  # this process can build it
            pool.reset(seed=0)
        with pytest.raises(ImportError) as raised:
            envfleet.make(env_id, 2, num_workers=2, context="spawn")
    finally:
        gymnasium.registry.pop(env_id, None)
    error = raised.value
    assert isinstance(error, envfleet.EnvError) and error.phase is envfleet.Phase.MAKE
    message = str(error.__cause__)
    assert f"'{module.__name__}:Env', which cannot be imported in this worker" in message
    assert "PYTHONPATH" in message and "context='fork'" in message and "py_modules" in message


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_env_fns_closures_under_fresh_start_methods(context: str) -> None:
    """Lambdas closing over a loop variable, as ``[make_env(i) for i in ...]`` code has them."""
    gravities = (9.81, 2.0, 15.0)
    env_fns = [lambda g=g: gymnasium.make("Pendulum-v1", g=g) for g in gravities]
    actions = np.random.default_rng(0).uniform(-2, 2, size=(3, 1))  # float64
    with (
        envfleet.make(env_fns, backend="process", num_workers=2, context=context) as pool,
        closing(SyncVectorEnv(env_fns)) as sync,
    ):
        assert pool.get_attr("g") == gravities
        assert_same(sync.reset(seed=1), pool.reset(seed=1))
        assert_same(sync.step(actions), pool.step(actions))


# -- observations the env gets wrong ---------------------------------------------------------


class BadObservationEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Env ``bad`` returns ``observation`` (wrong shape, or None) at its second step."""

    def __init__(self, bad: bool, observation: Any) -> None:
        self.observation_space = spaces.Box(-10, 10, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.bad, self.observation, self.t = bad, observation, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        obs = self.observation if self.bad and self.t == 2 else np.full(4, self.t, np.float32)
        return obs, 1.0, False, False, {}


BAD_OBSERVATIONS = {
    "(3,) for (4,)": np.zeros(3, np.float32),
    "(1,) broadcast": np.ones(1, np.float32),
    "None": None,
}


@pytest.mark.parametrize("observation", list(BAD_OBSERVATIONS.values()), ids=list(BAD_OBSERVATIONS))
def test_an_observation_that_does_not_fit_is_that_envs_failure(
    backend: str, observation: Any
) -> None:
    env_fns = [functools.partial(BadObservationEnv, i == 2, observation) for i in range(4)]
    with envfleet.make(env_fns, backend=backend, num_workers=2) as pool:
        pool.reset(seed=0)
        pool.step(np.zeros(4, np.int64))
        with pytest.raises(envfleet.EnvError, match="does not fit its observation space") as raised:
            pool.step(np.zeros(4, np.int64))
    error = raised.value
    assert (error.env_index, error.phase) == (2, envfleet.Phase.STEP)
    assert error.worker == (1 if backend != "serial" else 0)
    assert error.completed is not None
    assert sorted(error.completed[4]["env_id"].tolist()) == [0, 1, 3]  # no stale row for env 2
    np.testing.assert_array_equal(error.completed[0], np.full((3, 4), 2, np.float32))
    with envfleet.make(env_fns, backend=backend, num_workers=2, on_error="restart") as pool:
        pool.reset(seed=0)
        pool.step(np.zeros(4, np.int64))
        _, _, _, truncs, infos = pool.step(np.zeros(4, np.int64))
        assert truncs.tolist() == [False, False, True, False]
        assert infos["_envfleet/restarted"].tolist() == [False, False, True, False]
        assert pool.restarts.tolist() == [0, 0, 1, 0]


def test_async_misuse_is_gymnasiums_pending_call_errors(backend: str) -> None:
    """``send`` twice / ``recv`` with nothing sent: Gymnasium's ``step_async`` twice and
    ``step_wait`` first raise these types; envfleet's own errors subclass them."""
    with envfleet.make([CARTPOLE] * 2, backend=backend) as pool:
        pool.reset(seed=0)
        with pytest.raises(NoAsyncCallError):
            pool.recv()
        pool.send(np.array([0, 1]))
        with pytest.raises(AlreadyPendingCallError):
            pool.send(np.array([0, 1]))
        pool.recv()
