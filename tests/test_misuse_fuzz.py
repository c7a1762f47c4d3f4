"""Random sequences of calls, valid and not, on every backend: each call returns or raises a
named error at once, a caller's mistake leaves the pool usable (its next reset and step equal
``SyncVectorEnv``'s), and nothing is left behind (the leak check after each test)."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envfleet
from envfleet.gymnasium_async import PendingCall

NUM_ENVS = 3
ACTIONS = np.array([0, 1, 0])
CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
MISTAKES = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,  # get_attr of an attribute no env has: the env's own AttributeError
    envfleet.PoolStateError,
    gymnasium.error.Error,
)
"""What a call may raise: the caller's mistakes and the pool's misuse errors, never a failure
that breaks the pool."""

SEEDS = [None, 0, 7, -1, 1.5, "x", [1, 2, 3], [1.5] * 3, [-1, 0, 0], [1, 2], True]
OPTIONS = [
    None,
    {},
    5,
    "garbage",
    {"lock": threading.Lock()},  # cannot be pickled
    {"reset_mask": np.array([True, False, True])},
    {"reset_mask": np.zeros(NUM_ENVS, dtype=bool)},
    {"reset_mask": [True] * NUM_ENVS},
    {"reset_mask": np.ones(2, dtype=bool)},
]
ENV_IDS = [None, [0], [0, 1, 2], [-1], [3], [np.uint64(2**64 - 1)], "a", [0, 0], [], [1.0]]
ACTION_KINDS = ["valid", "short", "long", "float", "out of space", "lock", None]
NAMES = ["np_random_seed", "nonexistent", "spec", 5, None]
VALUES = [1, [1, 2, 3], [1, 2], "lock"]

OPS = st.one_of(
    st.tuples(st.just("reset"), st.sampled_from(SEEDS), st.sampled_from(OPTIONS)),
    st.tuples(st.just("step"), st.sampled_from(ACTION_KINDS), st.sampled_from(ENV_IDS)),
    st.tuples(st.just("send"), st.sampled_from(ACTION_KINDS), st.sampled_from(ENV_IDS)),
    st.tuples(st.just("recv")),
    st.tuples(
        st.just("async_reset"),
        st.sampled_from(SEEDS),
        st.sampled_from(OPTIONS),
        st.sampled_from(ENV_IDS),
    ),
    st.tuples(st.just("get_attr"), st.sampled_from(NAMES)),
    st.tuples(st.just("set_attr"), st.sampled_from(["foo", 3]), st.sampled_from(VALUES)),
    st.tuples(st.just("step_async"), st.sampled_from(ACTION_KINDS)),
    st.tuples(st.just("step_wait")),
    st.tuples(st.just("reset_async"), st.sampled_from(SEEDS), st.sampled_from(OPTIONS)),
    st.tuples(st.just("reset_wait")),
    st.tuples(st.just("close"), st.sampled_from(["soon", math.nan, math.inf])),
)


def _actions(kind: str | None, count: int) -> Any:
    if kind == "valid":
        return ACTIONS[:count].copy()
    if kind == "short":
        return np.zeros(max(count - 1, 0), dtype=np.int64)
    if kind == "long":
        return np.zeros(count + 1, dtype=np.int64)
    if kind == "float":
        return np.full(count, 0.5)
    if kind == "out of space":
        return np.full(count, 7)
    if kind == "lock":
        return [threading.Lock()] * count
    return kind


def _count(env_id: Any) -> int:
    try:
        return len(envfleet.validation.check_env_ids(env_id, NUM_ENVS))  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return NUM_ENVS


def _call(pool: envfleet.Pool, op: tuple[Any, ...]) -> None:
    name, args = op[0], op[1:]
    if name in ("step", "send"):
        getattr(pool, name)(_actions(args[0], _count(args[1])), args[1])
    elif name == "reset":
        pool.reset(seed=args[0], options=args[1])
    elif name == "step_async":
        pool.step_async(_actions(args[0], NUM_ENVS))
    elif name == "set_attr":
        pool.set_attr(args[0], threading.Lock() if args[1] == "lock" else args[1])
    elif name == "close":
        pool.close(timeout=args[0])
    else:
        getattr(pool, name)(*args)


def _settle(pool: envfleet.Pool) -> None:
    """Take in whatever the calls left in flight, as a caller would: recv() what is owed,
    sending the idle envs first when fewer than a batch are."""
    pool._gymnasium.pending = PendingCall.NONE  # a step_async or reset_async left pending
    idle = np.flatnonzero(pool._ledger.state == 0)
    if idle.size and 0 < pool._ledger.owed() < pool.batch_size:
        pool.send(ACTIONS[idle], idle)
    if pool._ledger.owed():
        pool.recv()


@functools.cache
def _expected() -> tuple[np.ndarray, np.ndarray]:
    reference = SyncVectorEnv([CARTPOLE] * NUM_ENVS)
    first = reference.reset(seed=123)[0]
    second = reference.step(ACTIONS)[0]
    reference.close()
    return first, second


@pytest.mark.parametrize("kind", ["serial", "thread", "process"])
def test_random_misuse_leaves_the_pool_usable(kind: str) -> None:
    pool = envfleet.make(
        CARTPOLE, NUM_ENVS, backend=kind, num_workers=2, check_actions=True, seed=0
    )

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(OPS, max_size=6))
    def calls(ops: list[tuple[Any, ...]]) -> None:
        pool.reset(seed=0)  # every env reset: a step is valid
        for op in ops:
            try:
                _call(pool, op)
            except MISTAKES:
                pass
            assert not pool.closed, op
        _settle(pool)
        first = pool.reset(seed=123)[0]
        np.testing.assert_array_equal(first, _expected()[0])
        np.testing.assert_array_equal(pool.step(ACTIONS)[0], _expected()[1])

    try:
        calls()
    finally:
        pool.close()
