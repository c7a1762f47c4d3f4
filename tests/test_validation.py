"""Bad input gets a clear ValueError/TypeError before anything reaches a worker.

The batch (count, shape) is always checked; action membership only with ``check_actions=True``
(as in Gymnasium, an action outside the space is otherwise the env's business), which the
pools here are made with.

After each refused call the pool must still work, and be exactly where it was: the envs are
counters (:class:`tests.envs.FaultyEnv`), so a step that slipped through would show in the
observations of the next good step.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium import spaces

import envfleet
import envfleet.validation
from tests.envs import DictTupleEnv, FaultyEnv

NUM_ENVS = 7
NUM_WORKERS = 3
SEED = 10
GOOD_ACTIONS = np.array([0, 1, 2, 0, 1, 2, 0])


class MultiDiscreteEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    """Counts its steps; takes MultiDiscrete([2, 3]) actions; reward is their sum."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 1000, shape=(1,), dtype=np.int64)
        self.action_space = spaces.MultiDiscrete([2, 3])
        self.count = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.count = 0
        return np.array([0]), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.action_space.contains(action), action
        self.count += 1
        return np.array([self.count]), float(np.sum(action)), False, False, {}


@pytest.fixture
def pool(backend: str) -> Iterator[envfleet.Pool]:
    """Seven counters over three workers, reset with ``SEED`` (env ``i`` starts at (SEED+i)*100)."""
    with envfleet.make(
        FaultyEnv,
        NUM_ENVS,
        backend=backend,
        num_workers=NUM_WORKERS,
        seed=SEED,
        check_actions=True,
    ) as pool:
        pool.reset()
        yield pool


def assert_untouched(pool: envfleet.Pool, steps_before: int = 0) -> None:
    """One good step works and shows that no env moved since the last good call."""
    obs, rewards, terminations, truncations, _ = pool.step(GOOD_ACTIONS)
    expected = [(SEED + i) * 100 + steps_before + 1 for i in range(NUM_ENVS)]
    np.testing.assert_array_equal(obs[:, 0], expected)
    np.testing.assert_array_equal(rewards, GOOD_ACTIONS.astype(np.float64))
    assert not terminations.any() and not truncations.any()


# -- actions -----------------------------------------------------------------------------------

BAD_DISCRETE_ACTIONS = {
    "too few": ([0] * 6, ValueError, r"shape \(7,\).*got shape \(6,\)"),
    "too many": ([0] * 8, ValueError, r"shape \(7,\).*got shape \(8,\)"),
    "scalar": (1, TypeError, r"batch of 7 actions.*got the scalar 1"),  # Gymnasium: TypeError
    "extra axis": (np.zeros((7, 1), dtype=np.int64), ValueError, r"shape \(7,\).*\(7, 1\)"),
    "floats": (np.zeros(7), TypeError, r"integer actions.*Discrete\(3\).*float64"),
    "float list": ([0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0], TypeError, r"integer actions"),
    "strings": (["a"] * 7, TypeError, r"integer actions"),
    "too high": ([0, 1, 2, 3, 0, 1, 2], ValueError, r"action 3 for env 3 is outside.*Discrete"),
    "negative": ([0, 1, 2, 0, 1, -1, 2], ValueError, r"action -1 for env 5 is outside"),
}


@pytest.mark.parametrize(
    ("actions", "error", "match"),
    list(BAD_DISCRETE_ACTIONS.values()),
    ids=list(BAD_DISCRETE_ACTIONS),
)
def test_bad_discrete_actions_are_refused(
    pool: envfleet.Pool, actions: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pool.step(actions)
    assert_untouched(pool)
    with pytest.raises(error, match=match):  # and again, mid-episode
        pool.step(actions)
    assert_untouched(pool, steps_before=1)


def test_bad_action_after_good_steps_changes_nothing(pool: envfleet.Pool) -> None:
    assert_untouched(pool)
    with pytest.raises(ValueError, match="env 6"):
        pool.step([0, 0, 0, 0, 0, 0, 9])
    with pytest.raises(ValueError, match="env 0"):
        pool.send([7, 0, 0, 0, 0, 0, 0])
    with pytest.raises(envfleet.NoPendingError):  # the refused send left nothing in flight
        pool.recv()
    assert_untouched(pool, steps_before=1)


BAD_MULTIDISCRETE_ACTIONS = {
    "one component": (np.zeros((7, 1), dtype=np.int64), ValueError, r"shape \(7, 2\)"),
    "flat": (np.zeros(7, dtype=np.int64), ValueError, r"shape \(7, 2\)"),
    "too few envs": (np.zeros((6, 2), dtype=np.int64), ValueError, r"shape \(7, 2\)"),
    "floats": (np.zeros((7, 2)), TypeError, r"integer actions.*MultiDiscrete"),
    "second too high": (
        np.array([[0, 0], [1, 2], [0, 3], [0, 0], [0, 0], [0, 0], [0, 0]]),
        ValueError,
        r"action \[0, 3\] for env 2 is outside.*MultiDiscrete",
    ),
    "first too high": (
        np.array([[0, 0], [1, 2], [0, 0], [0, 0], [0, 0], [0, 0], [2, 0]]),
        ValueError,
        r"action \[2, 0\] for env 6 is outside",
    ),
    "negative": (
        np.array([[0, 0], [0, -1], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]]),
        ValueError,
        r"for env 1 is outside",
    ),
}


@pytest.mark.parametrize(
    ("actions", "error", "match"),
    list(BAD_MULTIDISCRETE_ACTIONS.values()),
    ids=list(BAD_MULTIDISCRETE_ACTIONS),
)
def test_bad_multidiscrete_actions_are_refused(
    backend: str, actions: Any, error: type[Exception], match: str
) -> None:
    with envfleet.make(
        MultiDiscreteEnv, NUM_ENVS, backend=backend, num_workers=2, check_actions=True
    ) as pool:
        pool.reset(seed=0)
        with pytest.raises(error, match=match):
            pool.step(actions)
        good = np.array([[1, 2]] * NUM_ENVS)
        obs, rewards, _, _, _ = pool.step(good)
        np.testing.assert_array_equal(obs[:, 0], np.ones(NUM_ENVS))
        np.testing.assert_array_equal(rewards, np.full(NUM_ENVS, 3.0))


BAD_BOX_ACTIONS = {
    "wrong width": (np.zeros((7, 3), dtype=np.float32), ValueError, r"shape \(7, 2\)"),
    "too few envs": (np.zeros((5, 2), dtype=np.float32), ValueError, r"shape \(7, 2\)"),
    "flat": (np.zeros(14, dtype=np.float32), ValueError, r"shape \(7, 2\)"),
    "strings": (np.full((7, 2), "x"), TypeError, r"float32-compatible actions"),
}


@pytest.mark.parametrize(
    ("actions", "error", "match"), list(BAD_BOX_ACTIONS.values()), ids=list(BAD_BOX_ACTIONS)
)
def test_bad_box_actions_are_refused(
    backend: str, actions: Any, error: type[Exception], match: str
) -> None:
    with envfleet.make(
        DictTupleEnv, NUM_ENVS, backend=backend, num_workers=2, check_actions=True
    ) as pool:
        first, _ = pool.reset(seed=0)
        with pytest.raises(error, match=match):
            pool.step(actions)
        obs, _, _, _, infos = pool.step(np.zeros((NUM_ENVS, 2), dtype=np.float32))
        # A zero action keeps every walker where it started: nothing moved in between.
        np.testing.assert_array_equal(obs["pos"], first["pos"])
        np.testing.assert_array_equal(infos["t"], np.ones(NUM_ENVS))


# -- make() ------------------------------------------------------------------------------------

BAD_MAKE_ARGUMENTS = {
    "unknown id": (dict(env="NoSuchEnv-v0"), ValueError, r"unknown environment id 'NoSuchEnv-v0'"),
    "unknown ALE game": (dict(env="ALE/NoSuchGame-v5"), ValueError, r"unknown environment id"),
    "unknown backend": (
        dict(backend="gpu"),
        ValueError,
        r"unknown backend 'gpu': expected one of .*'serial'.*'process'",
    ),
    "zero envs": (dict(num_envs=0), ValueError, r"num_envs must be at least 1, got 0"),
    "negative envs": (dict(num_envs=-2), ValueError, r"num_envs must be at least 1, got -2"),
    "float envs": (dict(num_envs=2.0), TypeError, r"num_envs must be an int, got float"),
    "bool envs": (dict(num_envs=True), TypeError, r"num_envs must be an int, got bool"),
    "too many workers": (
        dict(num_envs=3, num_workers=4),
        ValueError,
        r"num_workers=4 exceeds num_envs=3",
    ),
    "zero workers": (dict(num_workers=0), ValueError, r"num_workers must be at least 1"),
    "batch too big": (
        dict(num_envs=3, batch_size=4),
        ValueError,
        r"batch_size=4 exceeds num_envs=3",
    ),
    "zero batch": (dict(batch_size=0), ValueError, r"batch_size must be at least 1"),
    "not callable": (dict(env=42), TypeError, r"registered id \(str\), an env class or a zero-arg"),
    "env instance": (dict(env="instance"), TypeError, r"not an instance \(CartPoleEnv\)"),
    "bad autoreset mode": (
        dict(autoreset_mode="sometimes"),
        ValueError,
        r"unknown autoreset_mode 'sometimes': expected one of",
    ),
    "bad context": (dict(context="thread"), ValueError, r"context must be one of"),
    "bad seed": (dict(seed="1"), TypeError, r"seed must be an int or None, got str"),
    "negative seed": (dict(seed=-1), ValueError, r"seed must be a non-negative int.*-1"),
    "infinite step_timeout": (
        dict(step_timeout=float("inf")),
        ValueError,
        r"step_timeout must be a finite, positive number of seconds, got inf",
    ),
    "nan step_timeout": (dict(step_timeout=float("nan")), ValueError, r"step_timeout.*nan"),
    "zero start_timeout": (dict(start_timeout=0), ValueError, r"start_timeout.*positive.*0"),
    "string start_timeout": (dict(start_timeout="5"), TypeError, r"start_timeout must be a"),
    "memory limit on threads": (
        dict(worker_memory_limit=1 << 30, backend="thread"),
        ValueError,
        r"worker_memory_limit needs a backend that can measure and replace a worker process: "
        r"process, ray; got backend='thread'",
    ),
    "zero memory limit": (dict(worker_memory_limit=0), ValueError, r"worker_memory_limit must"),
}


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    list(BAD_MAKE_ARGUMENTS.values()),
    ids=list(BAD_MAKE_ARGUMENTS),
)
def test_bad_make_arguments_are_refused(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {"env": "CartPole-v1", "num_envs": 2, "backend": "process"}
    arguments.update(overrides)
    if arguments["env"] == "instance":
        arguments["env"] = gymnasium.make("CartPole-v1").unwrapped
    with pytest.raises(error, match=match):
        envfleet.make(**arguments)


# -- reset() -----------------------------------------------------------------------------------

BAD_RESET_MASKS = {
    "int dtype": (np.ones(NUM_ENVS, dtype=np.int64), TypeError, r"dtype bool, got int64"),
    "short": (np.ones(NUM_ENVS - 1, dtype=np.bool_), ValueError, r"shape \(7,\), got \(6,\)"),
    "2-D": (np.ones((NUM_ENVS, 1), dtype=np.bool_), ValueError, r"shape \(7,\), got \(7, 1\)"),
    "list": ([True] * NUM_ENVS, TypeError, r"must be a numpy array"),
    "all false": (np.zeros(NUM_ENVS, dtype=np.bool_), ValueError, r"at least one env"),
}


@pytest.mark.parametrize(
    ("mask", "error", "match"), list(BAD_RESET_MASKS.values()), ids=list(BAD_RESET_MASKS)
)
def test_bad_reset_masks_are_refused(
    pool: envfleet.Pool, mask: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"reset_mask.*" + match):
        pool.reset(seed=0, options={"reset_mask": mask})
    assert_untouched(pool)  # no env was reset (seed 0 would have zeroed the counters)


@pytest.mark.parametrize("backend_name", ["process", "ray"])
def test_a_refused_make_starts_nothing(backend_name: str) -> None:
    """Every argument is checked before a worker (or Ray) starts."""
    if backend_name == "ray":
        ray = pytest.importorskip("ray")
        assert not ray.is_initialized()
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        envfleet.make(FaultyEnv, 2, backend=backend_name, seed=-1)
    # At once, not after a grace period: not even a worker that started and then exited.
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before
    if backend_name == "ray":
        assert not ray.is_initialized()


BAD_RESETS = {
    "float seeds": (dict(seed=[1.5] * NUM_ENVS), TypeError, r"seed\[0\] must be an int or None"),
    "negative seed": (dict(seed=-1), ValueError, r"seed must be a non-negative int, got -1"),
    "a negative seed": (
        dict(seed=[1, 2, -3, 4, 5, 6, 7]),
        ValueError,
        r"seed\[2\] must be a non-negative int, got -3",
    ),
    "string seed": (dict(seed="12"), TypeError, r"seed must be None, an int or one"),
    "int options": (dict(options=5), TypeError, r"options must be a dict .* got int 5"),
    "str options": (dict(options="garbage"), TypeError, r"options must be a dict .*'garbage'"),
}


@pytest.mark.parametrize(
    ("arguments", "error", "match"), list(BAD_RESETS.values()), ids=list(BAD_RESETS)
)
def test_caller_mistakes_in_reset_are_refused(
    pool: envfleet.Pool, arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        pool.reset(**arguments)
    with pytest.raises(error, match=match):
        pool.async_reset(**arguments)
    assert_untouched(pool)


def test_env_ids_beyond_intp_are_out_of_range_not_wrapped(pool: envfleet.Pool) -> None:
    huge = [np.uint64(2**64 - 1)]
    with pytest.raises(ValueError, match=r"env_id \[18446744073709551615\] out of range"):
        pool.send(np.zeros(1, dtype=np.int64), env_id=huge)
    assert_untouched(pool)


@pytest.mark.timeout(30)
def test_what_cannot_travel_leaves_the_pool_as_it_was() -> None:
    """A command is pickled before the pool changes: one that cannot be leaves it as it was
    (no env marked as sent, nothing waiting for a reply that will never come)."""
    lock = threading.Lock()
    with envfleet.make(
        FaultyEnv, NUM_ENVS, backend="process", num_workers=NUM_WORKERS, seed=SEED
    ) as pool:
        pool.reset()
        with pytest.raises(TypeError, match="pickle"):
            pool.reset(seed=0, options={"lock": lock})
        with pytest.raises(TypeError, match="pickle"):
            pool.set_attr("episode_length", lock)
        with pytest.raises(TypeError, match="pickle"):
            pool.call("poke", lock)
        assert pool.get_attr("episode_length") == (5,) * NUM_ENVS
        assert_untouched(pool)


def test_wrong_number_of_seeds_is_refused(pool: envfleet.Pool) -> None:
    with pytest.raises(ValueError, match=re.escape("expected 7 seeds (one per env), got 2")):
        pool.reset(seed=[1, 2])
    assert_untouched(pool)


def test_set_attr_with_wrong_number_of_values_is_refused(pool: envfleet.Pool) -> None:
    with pytest.raises(ValueError, match=r"one value per env \(7\), got 2"):
        pool.set_attr("episode_length", [3, 4])
    assert pool.get_attr("episode_length") == (5,) * NUM_ENVS
    assert_untouched(pool)


# -- closed pools ------------------------------------------------------------------------------

USES = {
    "step": lambda pool: pool.step([0, 0, 0]),
    "reset": lambda pool: pool.reset(),
    "send": lambda pool: pool.send([0, 0, 0]),
    "recv": lambda pool: pool.recv(),
    "async_reset": lambda pool: pool.async_reset(),
    "call": lambda pool: pool.call("get_wrapper_attr", "count"),
    "get_attr": lambda pool: pool.get_attr("count"),
    "set_attr": lambda pool: pool.set_attr("count", 0),
    "render": lambda pool: pool.render(),
}


@pytest.mark.parametrize("use", list(USES.values()), ids=list(USES))
def test_use_after_close_raises_closed_pool_error(backend: str, use: Any) -> None:
    pool = envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2)
    pool.reset()
    pool.close()
    assert pool.closed
    with pytest.raises(envfleet.ClosedPoolError, match="closed"):
        use(pool)
    pool.close()  # still fine


def test_close_twice_is_fine(backend: str) -> None:
    pool = envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2)
    pool.close()
    pool.close()
    assert pool.closed
    with envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2) as pool:
        pool.close()
    pool.close()


def test_disabled_mode_refuses_to_step_an_ended_env_until_it_is_reset(backend: str) -> None:
    with envfleet.make(
        FaultyEnv,
        4,
        backend=backend,
        num_workers=2,
        autoreset_mode="Disabled",
        env_kwargs={"episode_length": 2},
    ) as pool:
        pool.reset()
        pool.step([0, 0, 0, 0])
        pool.step([0, 0, 0, 0])  # the counters reach 2: every episode ended
        with pytest.raises(ValueError, match=r"envs \[0, 1, 2, 3\] ended.*DISABLED.*reset"):
            pool.step([1, 1, 1, 1])
        mask = np.array([True, False, True, False])
        pool.reset(options={"reset_mask": mask})
        with pytest.raises(ValueError, match=r"envs \[1, 3\] ended"):
            pool.step([1, 1, 1, 1])
        pool.reset(options={"reset_mask": ~mask})
        obs, rewards, terminations, _, _ = pool.step([1, 1, 1, 1])
        np.testing.assert_array_equal(obs[:, 0], [1, 1, 1, 1])  # no refused step slipped in
        np.testing.assert_array_equal(rewards, [1.0] * 4)
        assert not terminations.any()
        pool.step([0, 0, 0, 0])
        pool.reset()  # a full reset clears every env too
        obs, *_ = pool.step([2, 2, 2, 2])
        np.testing.assert_array_equal(obs[:, 0], [1, 1, 1, 1])


BIG = 8 << 20
"""Elements of :class:`BigBoxEnv`'s observation space (bounds of 8 MiB each)."""


class BigBoxEnv(gymnasium.Env[np.ndarray, np.int64]):
    """An env with an image-sized observation space (its bounds hold 16 MiB); given
    ``hang_unless_pid``, building it in any other process hangs (a worker that cannot start)."""

    def __init__(self, hang_unless_pid: int | None = None) -> None:
        if hang_unless_pid is not None and os.getpid() != hang_unless_pid:
            time.sleep(3600)  # in a worker: a constructor that never returns
        self.observation_space = spaces.Box(0, 255, shape=(BIG,), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(8, dtype=np.uint8), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(8, dtype=np.uint8), 0.0, False, False, {}


def test_big_box_spaces_are_compared_cheaply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every env's spaces are checked against env 0's; Box.__eq__ (np.allclose of the bounds)
    took seconds per image-sized env and made make() time out. Equal bounds are now found
    equal without it: make() calls it for no env, and the check costs a small fraction of
    Gymnasium's comparison of the same spaces, both measured here side by side (a ratio, not
    a fixed number of seconds)."""
    a, b = BigBoxEnv().observation_space, BigBoxEnv().observation_space
    started = time.perf_counter()
    assert a == b
    allclose_cost = time.perf_counter() - started
    cheap_cost = math.inf
    for _ in range(3):
        started = time.perf_counter()
        assert envfleet.validation.same_space(a, b)
        cheap_cost = min(cheap_cost, time.perf_counter() - started)
    assert cheap_cost * 5 < allclose_cost, (cheap_cost, allclose_cost)
    calls: list[int] = []
    box_eq = spaces.Box.__eq__
    monkeypatch.setattr(spaces.Box, "__eq__", lambda s, o: calls.append(1) or box_eq(s, o))
    with envfleet.make(BigBoxEnv, 4, backend="serial") as pool:
        assert pool.single_observation_space.shape == (BIG,)
    assert calls == []  # equal bounds: no np.allclose for any env
    # Bounds that differ still follow Gymnasium's tolerance (np.allclose) and its verdict.
    near = spaces.Box(0, 255 + 1e-9, shape=(4,), dtype=np.float64)
    far = spaces.Box(0, 254, shape=(4,), dtype=np.float64)
    box = spaces.Box(0, 255, shape=(4,), dtype=np.float64)
    nested = spaces.Dict({"image": a, "t": spaces.Tuple((spaces.Discrete(2), box))})
    assert envfleet.validation.same_space(nested, spaces.Dict(dict(nested.spaces)))
    assert calls == []
    assert envfleet.validation.same_space(box, near) and box == near
    assert not envfleet.validation.same_space(box, far) and box != far


@pytest.mark.timeout(120)
def test_a_start_timeout_says_what_a_worker_start_costs() -> None:
    """A worker past start_timeout: the message gives the costs measured in the caller (one
    env's build, envs per worker, the spaces' bytes), not only that it did not build in time."""
    factory = functools.partial(BigBoxEnv, hang_unless_pid=os.getpid())
    with pytest.raises(envfleet.EnvTimeoutError, match="within start_timeout") as raised:
        envfleet.make(factory, 2, backend="process", num_workers=1, start_timeout=3)
    message = str(raised.value)
    assert "building one env" in message and "a worker builds up to 2" in message, message
    assert "the spaces' bounds hold 16.8 MB" in message, message


@pytest.mark.parametrize(
    "space",
    [
        spaces.Discrete(3),
        spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
        spaces.MultiDiscrete([2, 3]),
        spaces.MultiBinary(2),
        spaces.Dict({"a": spaces.Discrete(2)}),
    ],
    ids=str,
)
@pytest.mark.parametrize("membership", [False, True])
def test_the_pools_action_check_is_check_actions(
    space: spaces.Space[Any], membership: bool
) -> None:
    """ActionCheck (the shape of a batch of every env worked out once) accepts, returns and
    refuses exactly what check_actions does, with the same exception and message."""
    n = 3
    check = envfleet.validation.ActionCheck(space, n)
    rng = np.random.default_rng(0)
    batches: list[Any] = (
        [np.stack([space.sample() for _ in range(n)])]
        if not isinstance(space, spaces.Dict)
        else [{"a": np.array([0, 1, 1])}]
    )
    batches += [
        [0] * n,
        np.full((n, 2), 7),  # outside most spaces (checked with membership only)
        np.full((n, 5), 0),
        np.full(n, 9, dtype=np.int64),
        np.zeros(n - 1, dtype=np.int64),
        5,
        rng.normal(size=(n, 2)),
        "abc",
        {"a": np.array([0, 5, 1])},
    ]
    for ids in (np.arange(n), np.array([0, 2])):
        for actions in batches:
            try:
                expected = envfleet.validation.check_actions(
                    space, actions, ids, check_membership=membership
                )
            except Exception as exc:
                with pytest.raises(type(exc), match=re.escape(str(exc))):
                    check(actions, ids, membership)
            else:
                got = check(actions, ids, membership)
                assert type(got) is type(expected)
                if isinstance(expected, np.ndarray):
                    assert got.dtype == expected.dtype and np.array_equal(got, expected)
