"""``pool.rollout(policy, steps)``: steps taken on the workers, with the policy run there.

Oracles: a rollout is, bit for bit, the same loop of ``SyncVectorEnv.step(policy(obs))`` (every
autoreset mode, nested spaces, infos, episodes ending mid-rollout), and plain steps and another
rollout after it go on as that loop does; under ``on_error="restart"`` it is the pool's own loop
of ``step``; under ``"raise"`` it raises the env's error as a step would. Bad input is refused
before anything is sent, and the pool stays usable.
"""

from __future__ import annotations

import copy
import functools
import pickle
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv

import envfleet
from envfleet import rollouts
from envfleet.group import RESTARTED
from tests.envs import DictTupleEnv, FaultyEnv
from tests.faults import SEED, VICTIM, exit_in_step, raise_value_error_in_step
from tests.test_equivalence import TextDictEnv

NUM_ENVS = 5
POLICY_SEED = 11
SCHEDULE = "p" * 7 + "f" * 3 + "p" * 6
"""The reference run's steps: ``p`` by the policy (a rollout), ``f`` fixed actions (steps)."""


def dict_envs(n: int = NUM_ENVS) -> list[Callable[[], gymnasium.Env[Any, Any]]]:
    """Nested observations, float32 actions, infos and reset infos; episodes of different
    lengths ending terminated or truncated, mid-rollout."""
    return [functools.partial(DictTupleEnv, max_steps=4 + i) for i in range(n)]


def assert_tree(ours: Any, theirs: Any, where: str) -> None:
    """Equal values, types and dtypes, through dicts, tuples and object arrays (infos)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), where
        for key in theirs:
            assert_tree(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs), where
        for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_tree(a, b, f"{where}[{k}]")
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), where
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        if theirs.dtype == object:
            for k, (a, b) in enumerate(zip(ours.flat, theirs.flat, strict=True)):
                assert_tree(a, b, f"{where}[{k}]")
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=where)
    else:
        assert type(ours) is type(theirs) and ours == theirs, where


def at(tree: Any, t: int) -> Any:
    """Step ``t`` of a rollout's nested ``(steps, num_envs, ...)`` arrays."""
    if isinstance(tree, dict):
        return {key: at(value, t) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(at(value, t) for value in tree)
    return tree[t]


def reference(
    venv: VectorEnv, policy: Any, schedule: str, fixed_seed: int = 3
) -> tuple[list[dict[str, Any]], Any]:
    """``venv`` reset with ``SEED`` then stepped by ``schedule``; per step what the policy saw,
    the actions and what the step returned (DISABLED mode: the envs that ended are reset
    first, with ``reset_mask``); and the last observations."""
    fixed = gymnasium.vector.utils.batch_space(venv.single_action_space, venv.num_envs)
    fixed.seed(fixed_seed)
    n = venv.num_envs
    obs, _ = venv.reset(seed=SEED)
    ended = np.zeros(n, dtype=np.bool_)
    record = []
    for kind in schedule:
        reset_infos: dict[str, Any] = {}
        if venv.metadata["autoreset_mode"] is AutoresetMode.DISABLED and ended.any():
            obs, reset_infos = venv.reset(options={"reset_mask": ended})
        actions = policy(obs, np.arange(n)) if kind == "p" else fixed.sample()
        after, rewards, terminations, truncations, infos = venv.step(actions)
        record.append(
            {
                "observations": obs,
                "actions": actions,
                "rewards": rewards,
                "terminations": terminations,
                "truncations": truncations,
                "infos": infos,
                "reset_infos": reset_infos,
                "next": after,
            }
        )
        obs, ended = after, terminations | truncations
    return record, obs


def assert_rollout(rollout: envfleet.Rollout, want: list[dict[str, Any]], label: str) -> None:
    assert rollout.steps == len(want), label
    for t, step in enumerate(want):
        where = f"{label} step {t}"
        for field in ("observations", "actions", "rewards", "terminations", "truncations"):
            assert_tree(at(getattr(rollout, field), t), step[field], f"{where} {field}")
        assert_tree(rollout.infos[t], step["infos"], f"{where} infos")
        assert_tree(rollout.reset_infos[t], step["reset_infos"], f"{where} reset_infos")


def assert_step_then_rollout(
    pool: envfleet.Pool, policy: Any, want: list[dict[str, Any]], last: Any, t: int
) -> None:
    """After a rollout of ``want[:t]``: a plain step (DISABLED mode: the envs that ended reset
    first, as after as many steps) and a second rollout of the rest, as ``want`` has them, the
    observations ``last`` after it."""
    ended = want[t - 1]["terminations"] | want[t - 1]["truncations"]
    if pool.autoreset_mode is AutoresetMode.DISABLED and ended.any():
        _, infos = pool.reset(options={"reset_mask": ended})
        assert_tree(infos, want[t]["reset_infos"], "reset after the rollout")
    got = pool.step(want[t]["actions"])
    assert_tree(got[0], want[t]["next"], "step observations")
    assert_tree(got[4], want[t]["infos"], "step infos")
    second = pool.rollout(policy, len(want) - t - 1)
    assert_rollout(second, want[t + 1 :], "second rollout")
    assert_tree(second.final_observations, last, "final observations")


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_rollout_is_that_many_steps_of_sync_vector_env(backend: str, mode: AutoresetMode) -> None:
    """Every backend (the suite's ``backend``). A rollout, plain steps, another rollout:
    SyncVectorEnv's run with the same policy and actions, bit for bit (nested observations,
    float32 actions, infos, episodes ending terminated and truncated mid-rollout; in DISABLED
    mode the rollout resets ended envs)."""
    ref = SyncVectorEnv(dict_envs(), autoreset_mode=mode)
    want, last = reference(
        ref, envfleet.RandomPolicy(ref.single_action_space, POLICY_SEED), SCHEDULE
    )
    ref.close()
    assert sum(int((s["terminations"] | s["truncations"]).sum()) for s in want[:7]) >= 3
    with envfleet.make(dict_envs(), backend=backend, num_workers=2, autoreset_mode=mode) as pool:
        policy = envfleet.RandomPolicy(pool.single_action_space, POLICY_SEED)
        pool.reset(seed=SEED)
        first = pool.rollout(policy, 7)
        assert_rollout(first, want[:7], "first rollout")
        assert_tree(first.final_observations, want[6]["next"], "final observations")
        if mode is AutoresetMode.DISABLED:  # the envs that ended need a reset, as after steps
            ended = want[6]["terminations"] | want[6]["truncations"]
            assert ended.any()
            with pytest.raises(ValueError, match="DISABLED"):
                pool.step(want[7]["actions"])
        for t in range(7, 10):  # plain steps go on from where the rollout left the envs
            step = want[t]
            ended = want[t - 1]["terminations"] | want[t - 1]["truncations"]
            if mode is AutoresetMode.DISABLED and ended.any():
                _, infos = pool.reset(options={"reset_mask": ended})
                assert_tree(infos, step["reset_infos"], f"reset before step {t}")
            got = pool.step(step["actions"])
            for k, field in enumerate(("next", "rewards", "terminations", "truncations")):
                assert_tree(got[k], step[field], f"step {t} {field}")
            assert_tree(got[4], step["infos"], f"step {t} infos")
        second = pool.rollout(policy, 6)  # the workers' copies of the policy go on
        assert_rollout(second, want[10:], "second rollout")
        assert_tree(second.final_observations, last, "final observations")
        stats = pool.stats()
        ended = sum(int((s["terminations"] | s["truncations"]).sum()) for s in want)
        assert (stats.steps, stats.episodes) == (len(want) * NUM_ENVS, ended)


def test_thread_workers_and_flat_spaces() -> None:
    """``threads_per_worker`` (a worker's envs on threads) and a Discrete action space: the same
    run as SyncVectorEnv's."""
    fns = [
        functools.partial(gymnasium.make, "CartPole-v1", max_episode_steps=5 + i) for i in range(6)
    ]
    ref = SyncVectorEnv(fns)
    want, last = reference(ref, envfleet.RandomPolicy(ref.single_action_space, 1), "p" * 12)
    ref.close()
    with envfleet.make(fns, backend="process", num_workers=2, threads_per_worker=2) as pool:
        pool.reset(seed=SEED)
        out = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 1), 12)
    assert_rollout(out, want, "rollout")
    assert_tree(out.final_observations, last, "final observations")


def faulty(n: int = 7, **kwargs: Any) -> list[Callable[[], FaultyEnv]]:
    return [functools.partial(FaultyEnv, **kwargs) for _ in range(n)]


def test_restart_mid_rollout_is_the_pools_own_loop_of_steps() -> None:
    """``on_error="restart"``: env ``VICTIM`` raises on its second step; the rollout goes on
    with it rebuilt (its episode reported truncated, ``envfleet/restarted``), exactly as the
    same pool's loop of ``step`` calls does, restart counts included."""
    runs = []
    for use_rollout in (True, False):
        with envfleet.make(
            faulty(step_hook=raise_value_error_in_step),
            backend="process",
            num_workers=3,
            on_error="restart",
        ) as pool:
            policy = envfleet.RandomPolicy(pool.single_action_space, 4)
            pool.reset(seed=SEED)
            if use_rollout:
                out = pool.rollout(policy, 6)
                runs.append(
                    (out.observations, out.rewards, out.truncations, out.infos, pool.restarts)
                )
                continue
            obs, steps = pool.reset(seed=SEED)[0], []
            for _ in range(6):
                after, rewards, _, truncations, infos = pool.step(policy(obs, np.arange(7)))
                steps.append((obs, rewards, truncations, infos))
                obs = after
            runs.append(
                (
                    np.stack([s[0] for s in steps]),
                    np.stack([s[1] for s in steps]),
                    np.stack([s[2] for s in steps]),
                    [s[3] for s in steps],
                    pool.restarts,
                )
            )
    (obs, rewards, truncations, infos, restarts), want = runs
    assert restarts[VICTIM] == 1 and want[4][VICTIM] == 1
    assert truncations[1, VICTIM] and infos[1][RESTARTED][VICTIM]
    assert_tree(obs, want[0], "observations")
    assert_tree(rewards, want[1], "rewards")
    assert_tree(truncations, want[2], "truncations")
    for t, (ours, theirs) in enumerate(zip(infos, want[3], strict=True)):
        assert_tree(ours, theirs, f"step {t} infos")
    np.testing.assert_array_equal(restarts, want[4])


def test_an_env_raising_mid_rollout_raises_as_a_step_would() -> None:
    """``on_error="raise"``: the env's own error type, naming the env and the step phase; the
    pool is broken, as after a failed step."""
    with envfleet.make(
        faulty(step_hook=raise_value_error_in_step), backend="process", num_workers=3
    ) as pool:
        pool.reset(seed=SEED)
        with pytest.raises(ValueError, match="boom in step") as caught:
            pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 5)
        error = caught.value
        assert isinstance(error, envfleet.EnvRaisedError)
        assert (error.env_index, error.phase) == (VICTIM, envfleet.Phase.STEP)
        assert f"env {VICTIM}" in str(error)
        with pytest.raises(envfleet.BrokenPoolError):
            pool.step(np.zeros(7, dtype=np.int64))


@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_a_worker_lost_mid_rollout(on_error: str) -> None:
    """Env ``VICTIM``'s worker (envs 3 and 4) exits on the rollout's second step. ``raise``:
    ``WorkerDiedError`` naming it. ``restart``: the worker is replaced and runs its part of the
    rollout again; its envs report their episodes truncated (``envfleet/restarted``) at the
    first step and start anew; the other workers' envs are untouched; the pool goes on."""
    with envfleet.make(
        faulty(step_hook=exit_in_step), backend="process", num_workers=3, on_error=on_error
    ) as pool:
        pool.reset(seed=SEED)
        policy = envfleet.RandomPolicy(pool.single_action_space, 0)
        if on_error == "raise":
            with pytest.raises(envfleet.WorkerDiedError, match="worker 1 holding envs") as caught:
                pool.rollout(policy, 5)
            assert caught.value.worker == 1 and caught.value.phase is envfleet.Phase.STEP
            return
        out = pool.rollout(policy, 5)
        lost = np.isin(np.arange(7), [3, 4])
        np.testing.assert_array_equal(out.truncations[0], lost)
        np.testing.assert_array_equal(out.infos[0]["_envfleet/restarted"], lost)
        assert (out.rewards[0][lost] == 0).all() and not out.truncations[1:].any()
        np.testing.assert_array_equal(pool.restarts, lost.astype(np.int64))
        counts = out.observations[:, :, 0]
        np.testing.assert_array_equal(counts[1, lost], counts[0, lost])  # its last one stands
        np.testing.assert_array_equal(counts[2:, lost], [[0, 0], [1, 1], [2, 2]])  # then anew
        np.testing.assert_array_equal(counts[:, ~lost][:, 0], SEED * 100 + np.arange(5))
        obs = pool.step(np.zeros(7, dtype=np.int64))[0]
        np.testing.assert_array_equal(obs[lost, 0], [4, 4])


class FailingPolicy:
    """Random actions, and an error on its ``fail_at``-th call (on each worker's copy)."""

    def __init__(self, fail_at: int) -> None:
        self.inner = envfleet.RandomPolicy(gymnasium.spaces.Discrete(3), 0)
        self.fail_at = fail_at
        self.calls = 0

    def __call__(self, observations: Any, env_ids: np.ndarray) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyError("policy broke")
        return self.inner(observations, env_ids)


@pytest.fixture(scope="module")
def thread_pool() -> Iterator[envfleet.Pool]:
    with envfleet.make(faulty(5), backend="thread", num_workers=2, batch_size=5) as pool:
        yield pool


def test_bad_input_is_refused_before_anything_is_sent(thread_pool: envfleet.Pool) -> None:
    pool = thread_pool
    policy = envfleet.RandomPolicy(pool.single_action_space, 0)
    with pytest.raises(envfleet.ResetNeededError):
        pool.rollout(policy, 3)
    pool.reset(seed=SEED)
    for steps in (0, -1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match="steps must be an int"):
            pool.rollout(policy, steps)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be callable"):
        pool.rollout(object(), 3)  # type: ignore[arg-type]
    lock = threading.Lock()
    with pytest.raises(TypeError, match="must pickle"):
        pool.rollout(lambda obs, ids, lock=lock: np.zeros(len(ids), dtype=np.int64), 3)
    pool.send(np.zeros(2, dtype=np.int64), env_id=[0, 1])  # an async step pending
    with pytest.raises(envfleet.AlreadyPendingError, match="rollout"):
        pool.rollout(policy, 3)
    pool.send(np.zeros(3, dtype=np.int64), env_id=[2, 3, 4])
    pool.recv()
    # Nothing was sent by the refusals: each env stepped once, by the async step above.
    assert pool.get_attr("count") == tuple(SEED * 100 + i * 100 + 1 for i in range(5))
    out = pool.rollout(policy, 3)
    assert out.observations.shape == (3, 5, 1) and out.actions.dtype == np.int64


def test_a_failing_policy_raises_and_the_pool_goes_on(thread_pool: envfleet.Pool) -> None:
    """The policy raises on its third call (on each worker): its error, named as the
    policy's; the envs stand after the two steps taken, and the pool steps on from there."""
    pool = thread_pool
    pool.reset(seed=SEED)
    with pytest.raises(KeyError, match="policy broke") as caught:
        pool.rollout(FailingPolicy(3), 5)
    assert "policy" in str(caught.value) and isinstance(caught.value, envfleet.EnvError)
    assert pool.get_attr("count") == tuple(SEED * 100 + i * 100 + 2 for i in range(5))
    obs = pool.step(np.zeros(5, dtype=np.int64))[0]
    np.testing.assert_array_equal(obs[:, 0], [SEED * 100 + i * 100 + 3 for i in range(5)])
    with pytest.raises(envfleet.EnvError, match=r"expected actions of shape \(3,\)"):
        pool.rollout(lambda obs, ids: np.zeros(1, dtype=np.int64), 2)  # worker 0 holds 3


def test_spaces_not_laid_out_as_arrays_are_refused() -> None:
    with envfleet.make(TextDictEnv, 2, backend="thread", num_workers=1) as pool:
        pool.reset(seed=SEED)
        with pytest.raises(ValueError, match="laid out as arrays"):
            pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 2)
        pool.step(np.zeros(2, dtype=np.int64))  # nothing was sent: the pool goes on


def int32_actions(observations: Any, env_ids: np.ndarray) -> np.ndarray:
    return (env_ids % 3).astype(np.int32)


def require_int32(env: FaultyEnv, action: Any) -> None:
    """A step hook: the action must reach the env as the policy gave it (int32, not cast)."""
    if np.asarray(action).dtype != np.int32:
        raise TypeError(f"the env got {np.asarray(action).dtype} actions")


def out_of_space(observations: Any, env_ids: np.ndarray) -> np.ndarray:
    return np.full(len(env_ids), 7, dtype=np.int64)


def test_actions_of_another_dtype_reach_the_envs_and_check_actions_applies() -> None:
    """int32 actions for a Discrete (int64) space reach the envs as given (FaultyEnv's reward is
    its action) and are recorded in the space's dtype; ``make(check_actions=True)`` refuses
    actions outside the space on the workers, as ``step`` does, and the pool goes on."""
    with envfleet.make(
        faulty(4, step_hook=require_int32), backend="thread", num_workers=2, check_actions=True
    ) as pool:
        pool.reset(seed=SEED)
        out = pool.rollout(int32_actions, 3)
        assert out.actions.dtype == np.int64
        np.testing.assert_array_equal(out.actions, np.tile(np.arange(4) % 3, (3, 1)))
        np.testing.assert_array_equal(out.rewards, out.actions.astype(np.float64))
        with pytest.raises(envfleet.EnvError, match="outside the action space"):
            pool.rollout(out_of_space, 2)
        pool.step(np.zeros(4, dtype=np.int32))


def test_a_closed_pool_refuses() -> None:
    pool = envfleet.make(faulty(2), backend="thread", num_workers=1)
    pool.reset(seed=SEED)
    pool.close()
    with pytest.raises(envfleet.ClosedPoolError):
        pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 2)


def test_step_timeout_and_latency_are_per_step_of_a_rollout() -> None:
    """20 steps of 20 ms: 0.4 s in all, past ``step_timeout=0.25`` but no step near it; the
    worker is not killed, and ``stats()`` reports the latency of a step."""
    with envfleet.make(
        faulty(2, sleep=0.02), backend="process", num_workers=2, step_timeout=0.25
    ) as pool:
        pool.reset(seed=SEED)
        out = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 20)
        stats = pool.stats()
    assert out.steps == 20 and not out.truncations.any()
    # Its latency per step (20 ms: the slowest reply, the reset the other), not 0.4 s.
    assert all(0.015 < w.latency_p99_ms / 1e3 < 0.2 for w in stats.workers), stats.workers


def test_a_policy_of_main_pickles_by_value() -> None:
    """A policy whose class lives in ``__main__`` (a script's) unpickles in a process that
    lacks it (a worker on another node), as cloudpickle makes it; one of an importable module
    travels by reference."""
    main = types.new_class("ScriptPolicy", (FailingPolicy,))
    main.__module__ = "__main__"
    sys.modules["__main__"].ScriptPolicy = main  # type: ignore[attr-defined]
    try:
        for policy in (main(9), FailingPolicy(9)):
            blob = rollouts.policy_bytes(policy)
            code = "import pickle, sys; print(type(pickle.loads(sys.stdin.buffer.read())).__name__)"
            done = subprocess.run(
                [sys.executable, "-c", code], input=blob, capture_output=True, timeout=60
            )
            assert done.stdout.decode().strip() == type(policy).__name__, done.stderr.decode()
    finally:
        del sys.modules["__main__"].ScriptPolicy  # type: ignore[attr-defined]


def test_random_policy_draws_per_env_whatever_the_split() -> None:
    policy = envfleet.RandomPolicy(gymnasium.spaces.MultiDiscrete([3, 4]), seed=2)
    whole = [policy(None, np.arange(4)) for _ in range(3)]
    split = envfleet.RandomPolicy(gymnasium.spaces.MultiDiscrete([3, 4]), seed=2)
    for draw in whole:
        halves = [split(None, np.array([0, 1])), split(None, np.array([2, 3]))]
        np.testing.assert_array_equal(np.concatenate(halves), draw)
    assert whole[0].dtype == np.int64 and not (whole[0] == whole[1]).all()
    for i in range(4):  # env i draws from the space seeded with seed + i
        space = gymnasium.spaces.MultiDiscrete([3, 4], seed=2 + i)
        np.testing.assert_array_equal([space.sample() for _ in range(3)], [w[i] for w in whole])
    assert pickle.loads(pickle.dumps(policy))(None, np.arange(4)).shape == (4, 2)


@pytest.mark.parametrize(
    "space",
    [
        gymnasium.spaces.Discrete(5, start=-2),
        gymnasium.spaces.Discrete(7, dtype=np.int32),
        gymnasium.spaces.Discrete(2),
    ],
    ids=str,
)
def test_random_policy_on_discrete_draws_what_the_space_would(
    space: gymnasium.spaces.Discrete,
) -> None:
    """Discrete's draws (taken without ``Space.sample``'s checks) are the space's own, in its
    dtype; the policy's pickle is kept between rollouts only while it is not called here."""
    policy = envfleet.RandomPolicy(space, seed=3)
    draws = [policy(None, np.arange(5)) for _ in range(4)]
    assert all(d.dtype == space.dtype for d in draws)
    for i in range(5):
        own = copy.deepcopy(space)
        own.seed(3 + i)
        assert [own.sample() for _ in range(4)] == [int(d[i]) for d in draws]
    before = rollouts.policy_bytes(policy)
    assert rollouts.policy_bytes(policy) is before  # kept: the driver's copy did not move
    fifth = policy(None, np.arange(5))  # it moves: what travels next is where it is now
    np.testing.assert_array_equal(pickle.loads(before)(None, np.arange(5)), fifth)
    moved = pickle.loads(rollouts.policy_bytes(policy))
    np.testing.assert_array_equal(moved(None, np.arange(5)), policy(None, np.arange(5)))
    kept = rollouts.policy_bytes(policy)
    policy.seed = 10  # another seed: pickled anew
    assert pickle.loads(rollouts.policy_bytes(policy)).seed == 10 and kept is not None


@pytest.mark.parametrize(
    "ids", [[4], [2, 3], [0, 1, 2, 3, 4, 5], [1, 3], [0, 2, 3], [5, 1, 2], [2, 3, 5, 6]]
)
def test_a_parts_rows_are_copied_out_as_fancy_indexing_would(ids: list[int]) -> None:
    """The loop copies a part's rows of the batch from a view where its env ids are
    consecutive, else by a gather: both give ``batch[ids]``."""
    from envfleet.batch_rows import BlockRows, row_index

    batch = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    index = np.array(ids, dtype=np.intp)
    rows = row_index(index)
    consecutive = ids == list(range(ids[0], ids[0] + len(ids)))
    assert isinstance(rows, slice) == consecutive
    out = np.full((len(ids), 3), -1, np.float32)
    BlockRows(batch, rows).into(out)
    np.testing.assert_array_equal(out, batch[index])


class ScalarInfoEnv(gymnasium.Env[np.ndarray, int]):
    """Infos of plain scalars of five types every step (kept as arrays in a rollout, stacked
    by the pool), none from env 0 on odd steps (those steps merge env by env), and another
    key on reset; episodes of ``4 + index`` steps."""

    observation_space = gymnasium.spaces.Box(-1e6, 1e6, (2,), np.float64)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self, index: int) -> None:
        self.index, self.t = index, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.t = int(self.np_random.integers(0, 5))
        return np.array([self.index, self.t], dtype=np.float64), {"start": self.t}

    def step(self, action: int) -> Any:
        self.t += 1 + int(action)
        info = {
            "lives": 3 - self.t % 3,
            "x": self.t / 7,
            "alive": self.t % 2 == 0,
            "n32": np.int32(self.t),
            "f32": np.float32(self.t / 3),
        }
        if self.index == 0 and self.t % 2:
            info = {}
        obs = np.array([self.index, self.t], dtype=np.float64)
        return obs, float(action), self.t > 4 + self.index, False, info


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
def test_a_rollouts_scalar_infos_are_sync_vector_envs(backend: str, mode: AutoresetMode) -> None:
    """Every env's infos alike (plain scalars) travel as arrays and are stacked by the pool;
    steps where one env has none, or where envs reset beside others stepping, merge env by
    env; in DISABLED mode, the resets' infos too: SyncVectorEnv's infos either way, key for
    key, type for type."""
    fns = [functools.partial(ScalarInfoEnv, i) for i in range(NUM_ENVS)]
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    want, last = reference(ref, envfleet.RandomPolicy(ref.single_action_space, 0), "p" * 12)
    ref.close()
    assert any(len(step["infos"]) == 10 for step in want)  # every env's: stacked
    assert any(0 < step["infos"]["_lives"].sum() < NUM_ENVS for step in want)  # merged
    if mode is AutoresetMode.DISABLED:
        assert any(step["reset_infos"] for step in want)
    with envfleet.make(fns, backend=backend, num_workers=2, autoreset_mode=mode) as pool:
        pool.reset(seed=SEED)
        got = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 12)
    assert_rollout(got, want, "rollout")
    assert_tree(got.final_observations, last, "final observations")
