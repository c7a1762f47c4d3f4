"""The Pool is a Gymnasium ``VectorEnv``: its attributes, call/get_attr/set_attr/render, closing."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space

import envfleet
from tests.conftest import PROCESS_BACKENDS
from tests.envs import DictTupleEnv, FaultyEnv

NUM_ENVS = 7
NUM_WORKERS = 3
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


class CallableEnv(FaultyEnv):
    """A FaultyEnv with a method taking positional and keyword arguments."""

    def scaled(self, x: int, *, factor: int = 1) -> tuple[int | None, int]:
        return self.seed_used, x * factor


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_pool_is_a_vector_env(backend: str, mode: AutoresetMode) -> None:
    with envfleet.make(
        "CartPole-v1", NUM_ENVS, backend=backend, num_workers=NUM_WORKERS, autoreset_mode=mode
    ) as pool:
        assert isinstance(pool, VectorEnv)
        assert isinstance(pool, envfleet.Pool)
        assert pool.num_envs == NUM_ENVS
        assert pool.single_observation_space.shape == (4,)
        assert pool.single_action_space.n == 2
        assert pool.observation_space == batch_space(pool.single_observation_space, NUM_ENVS)
        assert pool.action_space == batch_space(pool.single_action_space, NUM_ENVS)
        assert pool.observation_space.shape == (NUM_ENVS, 4)
        assert pool.autoreset_mode is mode
        assert pool.metadata["autoreset_mode"] is mode
        assert pool.metadata["render_fps"] == 50  # CartPole's own metadata is kept
        assert pool.render_mode is None
        assert pool.unwrapped is pool
        assert not pool.closed
        obs, infos = pool.reset(seed=0)
        assert obs.shape == (NUM_ENVS, 4) and obs.dtype == np.float32
        assert isinstance(infos, dict)
        obs, rewards, terminations, truncations, infos = pool.step(pool.action_space.sample())
        assert obs.shape == (NUM_ENVS, 4) and obs.dtype == np.float32
        assert rewards.shape == (NUM_ENVS,) and rewards.dtype == np.float64
        assert terminations.shape == (NUM_ENVS,) and terminations.dtype == np.bool_
        assert truncations.shape == (NUM_ENVS,) and truncations.dtype == np.bool_
        assert isinstance(infos, dict)


@pytest.mark.parametrize("given", ["SameStep", "same_step", "SAME_STEP"])
def test_autoreset_mode_accepts_its_string_value_or_name(backend: str, given: str) -> None:
    with envfleet.make("CartPole-v1", 2, backend=backend, autoreset_mode=given) as pool:
        assert pool.autoreset_mode is AutoresetMode.SAME_STEP
        assert pool.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP


def test_make_seed_seeds_the_action_spaces(backend: str) -> None:
    samples = []
    for _ in range(2):
        with envfleet.make("CartPole-v1", NUM_ENVS, backend=backend, seed=3) as pool:
            samples.append((pool.action_space.sample(), pool.single_action_space.sample()))
    np.testing.assert_array_equal(samples[0][0], samples[1][0])
    assert samples[0][1] == samples[1][1]


def test_call_get_attr_and_set_attr_round_trip(backend: str) -> None:
    with envfleet.make(CallableEnv, NUM_ENVS, backend=backend, num_workers=NUM_WORKERS) as pool:
        pool.reset(seed=100)
        seeds = tuple(100 + i for i in range(NUM_ENVS))
        assert pool.call("scaled", 3, factor=2) == tuple((s, 6) for s in seeds)
        assert pool.call("scaled", 5) == tuple((s, 5) for s in seeds)
        assert pool.call("get_wrapper_attr", "episode_length") == (5,) * NUM_ENVS
        assert pool.get_attr("episode_length") == (5,) * NUM_ENVS
        assert pool.call("episode_length") == (5,) * NUM_ENVS  # attributes read through call

        pool.set_attr("episode_length", 2)  # one value for every env
        assert pool.get_attr("episode_length") == (2,) * NUM_ENVS
        pool.step(np.zeros(NUM_ENVS, dtype=np.int64))
        _, _, terminations, _, _ = pool.step(np.zeros(NUM_ENVS, dtype=np.int64))
        assert terminations.all()  # the new value is what the envs use

        values = [10 * i + 1 for i in range(NUM_ENVS)]
        pool.set_attr("episode_length", values)  # one value per env
        assert pool.get_attr("episode_length") == tuple(values)
        pool.set_attr("tag", tuple(f"env-{i}" for i in range(NUM_ENVS)))  # a tuple: per env too
        assert pool.get_attr("tag") == tuple(f"env-{i}" for i in range(NUM_ENVS))
        pool.set_attr("tag", {"shared": True})  # any other object is broadcast
        assert pool.get_attr("tag") == ({"shared": True},) * NUM_ENVS


def test_render_returns_one_frame_per_env(backend: str) -> None:
    with envfleet.make(
        DictTupleEnv,
        NUM_ENVS,
        backend=backend,
        num_workers=NUM_WORKERS,
        env_kwargs={"render_mode": "rgb_array"},
    ) as pool:
        assert pool.render_mode == "rgb_array"
        pool.reset(seed=0)
        for _ in range(2):  # DictTupleEnv episodes last at least 3 steps
            pool.step(np.zeros((NUM_ENVS, 2), dtype=np.float32))
        frames = pool.render()
        assert isinstance(frames, tuple) and len(frames) == NUM_ENVS
        for frame in frames:
            np.testing.assert_array_equal(frame, np.full((4, 4, 3), 2, dtype=np.uint8))


def test_context_manager_closes(backend: str) -> None:
    with envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2) as pool:
        pool.reset()
        assert not pool.closed
    assert pool.closed
    with pytest.raises(envfleet.ClosedPoolError):
        pool.step([0, 0, 0])


def test_context_manager_closes_on_error(backend: str) -> None:
    with (
        pytest.raises(KeyError, match="inside the block"),
        envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2) as pool,
    ):
        raise KeyError("inside the block")
    assert pool.closed


def test_a_pool_dropped_unclosed_is_freed_at_once(backend: str) -> None:
    """Nothing of a pool refers back to it: dropped without close(), it is freed (and its
    ``__del__`` closes it) as its last reference goes, not when the garbage collector runs."""
    gc.disable()
    try:
        pool = envfleet.make(FaultyEnv, 3, backend=backend, num_workers=2)
        pool.reset(seed=0)
        pool.step([0, 0, 0])
        pool.get_attr("seed_used")
        freed = weakref.ref(pool)
        del pool
        assert freed() is None
    finally:
        gc.enable()


def test_close_from_another_thread_ends_a_waiting_step(backend: str) -> None:
    """close() from another thread while a step waits: the step ends with ClosedPoolError (it
    raised the env's KeyError on serial, multiprocessing's ValueError on process)."""
    pool = envfleet.make(FaultyEnv, 2, backend=backend, num_workers=2, env_kwargs={"sleep": 0.6})
    pool.reset()
    closer = threading.Timer(0.2, pool.close, kwargs={"timeout": 0.2})
    closer.start()
    with pytest.raises(envfleet.ClosedPoolError):
        pool.step(np.zeros(2, dtype=np.int64))
    closer.join()
    assert pool.closed


def test_close_from_another_thread_before_the_step_waits(backend: str) -> None:
    """The other order of that race, forced: another thread's close() ends, workers gone and
    their descriptors closed, after the step sent its commands and before it waits. The wait
    polled the closed (or reused) descriptors for ever on process; it ends with
    ClosedPoolError."""
    pool = envfleet.make(FaultyEnv, 2, backend=backend, num_workers=2, env_kwargs={"sleep": 0.3})
    pool.reset()
    transport = pool._transport
    submit = transport.submit
    sent: list[int] = []

    def submit_then_close(worker: int, command: Any) -> None:
        submit(worker, command)
        sent.append(worker)
        if len(sent) == pool.num_workers:  # the step's last command: closed before the wait
            closer = threading.Thread(target=pool.close, kwargs={"timeout": 0.2})
            closer.start()
            closer.join()

    transport.submit = submit_then_close  # type: ignore[method-assign]
    if hasattr(transport, "submit_all"):  # a whole-pool step goes through this hook instead
        submit_all = transport.submit_all

        def submit_all_then_close(*args: Any, **kwargs: Any) -> Any:
            result = submit_all(*args, **kwargs)
            closer = threading.Thread(target=pool.close, kwargs={"timeout": 0.2})
            closer.start()
            closer.join()
            return result

        transport.submit_all = submit_all_then_close  # type: ignore[method-assign]
    with pytest.raises(envfleet.ClosedPoolError):
        pool.step(np.zeros(2, dtype=np.int64))
    assert pool.closed


@pytest.mark.parametrize("kind", PROCESS_BACKENDS)
def test_a_forked_child_cannot_stop_its_parents_pool(kind: str) -> None:
    """A child forked while a pool is open inherits it: it cannot use it (ClosedPoolError), and
    its close() and exit (multiprocessing's exit handler terminates daemonic children) leave
    the parent's workers alone. They used to get Close, then SIGTERM."""
    import multiprocessing.util

    with envfleet.make(FaultyEnv, 2, backend=kind, num_workers=2, seed=0) as pool:
        pool.reset()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit code
            code = 1
            try:
                pool.close()
                try:
                    pool.step(np.zeros(2, dtype=np.int64))
                except envfleet.ClosedPoolError as exc:
                    code = 0 if "forked child" in str(exc) else 2
                multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0
        observations = pool.step(np.zeros(2, dtype=np.int64))[0]
        np.testing.assert_array_equal(observations.ravel(), [1, 101])


def _eventfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "eventfd" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed since
            pass
    return count


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the thread backend's bells are eventfds")
def test_thread_close_that_stops_waiting_still_frees_the_bells() -> None:
    """close(timeout=0) returns before the worker threads end: the last one to end closes the
    pool's eventfds (4 of them leaked per pool closed that way)."""
    before = _eventfds()
    threads = threading.active_count()
    pool = envfleet.make(FaultyEnv, 2, backend="thread", num_workers=2)
    pool.reset()
    pool.close(timeout=0)
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _eventfds() == before


def test_uneven_split_over_workers(backend: str) -> None:
    """7 envs over 3 workers: contiguous blocks of 3, 2 and 2, each env stepped exactly once."""
    with envfleet.make(FaultyEnv, NUM_ENVS, backend=backend, num_workers=NUM_WORKERS) as pool:
        pool.reset(seed=0)
        pids = pool.get_attr("pid")
        for t in range(1, 4):
            actions = np.array([t % 3] * NUM_ENVS)
            obs, rewards, _, _, _ = pool.step(actions)
            np.testing.assert_array_equal(obs[:, 0], [i * 100 + t for i in range(NUM_ENVS)])
            np.testing.assert_array_equal(rewards, actions.astype(np.float64))
    if backend in PROCESS_BACKENDS:
        assert pids[0] == pids[1] == pids[2] != pids[3] == pids[4] != pids[5] == pids[6]
        assert len(set(pids)) == NUM_WORKERS
        assert os.getpid() not in pids
    else:
        assert set(pids) == {os.getpid()}


def test_default_num_workers_and_one_env(backend: str) -> None:
    with envfleet.make(FaultyEnv, 1, backend=backend) as pool:
        obs, _ = pool.reset(seed=1)
        np.testing.assert_array_equal(obs, [[100]])
        obs, rewards, _, _, _ = pool.step([2])
        np.testing.assert_array_equal(obs, [[101]])
        np.testing.assert_array_equal(rewards, [2.0])


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_closures_work_under_every_start_method(context: str) -> None:
    length = 3  # captured by both factories below: they must travel by value

    def factory() -> FaultyEnv:
        return FaultyEnv(episode_length=length)

    for env in (factory, lambda: FaultyEnv(episode_length=length)):
        with envfleet.make(env, 2, num_workers=2, context=context) as pool:
            pool.reset()  # counters start at 0 and end their episode at ``length``
            assert pool.get_attr("episode_length") == (length, length)
            pids = pool.get_attr("pid")
            assert len(set(pids)) == 2 and os.getpid() not in pids
            for _ in range(length):
                obs, _, terminations, _, _ = pool.step([1, 1])
            assert terminations.all()
            np.testing.assert_array_equal(obs[:, 0], [length, length])


def test_env_kwargs_reach_gymnasium_make(backend: str) -> None:
    with envfleet.make(
        "CartPole-v1", 3, backend=backend, env_kwargs={"max_episode_steps": 4}
    ) as pool:
        pool.reset(seed=0)
        for t in range(4):
            _, _, terminations, truncations, _ = pool.step([0, 1, 0] if t % 2 else [1, 0, 1])
            assert not terminations.any()
            assert truncations.all() == (t == 3), f"step {t}: {truncations}"


def test_env_kwargs_reach_an_env_class(backend: str) -> None:
    with envfleet.make(
        FaultyEnv, 4, backend=backend, num_workers=2, env_kwargs={"episode_length": 2}
    ) as pool:
        assert pool.get_attr("episode_length") == (2,) * 4
        pool.reset()
        pool.step([0] * 4)
        _, _, terminations, _, _ = pool.step([0] * 4)
        assert terminations.all()


def test_env_kwargs_reach_a_factory(backend: str) -> None:
    def factory(**kwargs: Any) -> FaultyEnv:
        return FaultyEnv(**kwargs)

    with envfleet.make(factory, 2, backend=backend, env_kwargs={"episode_length": 9}) as pool:
        assert pool.get_attr("episode_length") == (9, 9)


def test_env_class_as_env(backend: str) -> None:
    with envfleet.make(DictTupleEnv, 3, backend=backend, num_workers=2) as pool:
        assert pool.single_observation_space == DictTupleEnv().observation_space
        assert pool.single_action_space == DictTupleEnv().action_space
        obs, infos = pool.reset(seed=0)
        assert set(obs) == {"pos", "pair", "grid"}
        assert obs["pos"].shape == (3, 2)
        assert infos["start"].shape == (3, 2) and infos["_start"].all()


def test_results_are_not_overwritten_by_later_steps(backend: str) -> None:
    with envfleet.make("CartPole-v1", 4, backend=backend, num_workers=2) as pool:
        obs, _ = pool.reset(seed=0)
        kept = [obs.copy()]
        held = [obs]
        for t in range(5):
            result = pool.step(np.array([t % 2] * 4))
            held.append(result[0])
            kept.append(result[0].copy())
            held_rewards = result[1]
            held_rewards_copy = result[1].copy()
        pool.reset(seed=1)
        pool.step(np.zeros(4, dtype=np.int64))
        for old, copy in zip(held, kept, strict=True):
            np.testing.assert_array_equal(old, copy)
        np.testing.assert_array_equal(held_rewards, held_rewards_copy)


class FramesEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Frames of 12 KB (the step count in every pixel)."""

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0 if seed is None else seed
        return np.full((64, 64, 3), self.t % 256, np.uint8), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.full((64, 64, 3), self.t % 256, np.uint8), 0.0, False, False, {}


@pytest.mark.parametrize("batch_size", [8, 4])
def test_large_observations_held_never_change(backend: str, batch_size: int) -> None:
    """Observations the caller holds in any way (a variable, a list, a view of one) never
    change, sync and async: the pool hands out copies (``copy=True``)."""
    n = 8
    with envfleet.make(FramesEnv, n, backend=backend, batch_size=batch_size, seed=0) as pool:
        obs, _ = pool.reset()
        pool.send(np.zeros(n, dtype=np.int64))
        held: list[tuple[np.ndarray, np.ndarray]] = []
        view = None
        steps = np.zeros(n, dtype=np.int64)
        for t in range(12):
            obs, _, _, _, infos = pool.recv()
            ids = infos["env_id"]
            steps[ids] += 1
            values = (ids + steps[ids]) % 256  # env i starts at its seed, i
            np.testing.assert_array_equal(
                obs, np.broadcast_to(values[:, None, None, None], obs.shape)
            )
            if t % 3 == 0:
                held.append((obs, obs.copy()))
            if t == 4:
                view = (obs[1], obs[1].copy())
            pool.send(np.zeros(batch_size, dtype=np.int64), ids)
            del obs
        for kept, copied in held:
            np.testing.assert_array_equal(kept, copied)
        assert view is not None
        np.testing.assert_array_equal(view[0], view[1])
        pool.recv()
        if batch_size < n:
            pool.recv()


def test_copy_false_returns_the_batch_arrays_themselves(backend: str) -> None:
    """Same values as copies; the arrays are the pool's own, which the next step overwrites."""
    actions = np.ones(NUM_ENVS, dtype=np.int64)
    common = {"backend": backend, "seed": 0}
    with (
        envfleet.make("CartPole-v1", NUM_ENVS, copy=False, **common) as views,
        envfleet.make("CartPole-v1", NUM_ENVS, **common) as copies,
    ):
        reset_view, _ = views.reset()
        reset_copy, _ = copies.reset()
        np.testing.assert_array_equal(reset_view, reset_copy)
        step_view = views.step(actions)[0]
        step_copy = copies.step(actions)[0]
        np.testing.assert_array_equal(step_view, step_copy)
        assert np.shares_memory(step_view, reset_view), "not the batch arrays"
        np.testing.assert_array_equal(reset_view, step_copy)  # the reset's were overwritten
        assert not np.array_equal(reset_copy, step_copy)
        assert not np.shares_memory(step_copy, copies.step(actions)[0])


@pytest.mark.parametrize("where", ["process", "thread"])
def test_copy_false_async_batches_of_one_worker_are_views(where: str) -> None:
    """Double buffering on two workers: each async batch is one worker's block of envs, handed
    out as a view of the batch arrays (no copy for ``torch.from_numpy``); a batch that is not a
    run of consecutive envs is a copy. Values are the same as a copying pool's, env by env."""
    n = 6
    common = {"backend": where, "seed": 0, "num_workers": 2, "batch_size": 3}
    with (
        envfleet.make("CartPole-v1", n, copy=False, **common) as views,
        envfleet.make("CartPole-v1", n, **common) as copies,
    ):
        expected: dict[int, list[bytes]] = {i: [] for i in range(n)}
        got: dict[int, list[bytes]] = {i: [] for i in range(n)}
        for pool, record, is_view in ((copies, expected, False), (views, got, True)):
            pool.async_reset()
            # Until every env has two results. Which worker answers first is the scheduler's
            # choice (on a busy machine one may win many times in a row), so a block that is
            # ahead waits for the other's next batch before it is sent again.
            held = None
            for _ in range(40):
                if min(len(record[i]) for i in range(n)) >= 2:
                    break
                obs, _, _, _, infos = pool.recv()
                ids = infos["env_id"]
                assert sorted(ids.tolist()) in ([0, 1, 2], [3, 4, 5])  # one worker's block
                assert np.shares_memory(obs, pool._batch.observations) is is_view
                for k, i in enumerate(ids.tolist()):
                    record[i].append(obs[k].tobytes())
                if held is not None:
                    pool.send(np.ones(3, dtype=np.int64), held)
                    held = None
                if len(record[ids[0]]) > len(record[(ids[0] + 3) % n]):
                    held = ids  # ahead: the other block is in flight, its batch comes next
                else:
                    pool.send(np.ones(3, dtype=np.int64), ids)
        for i in range(n):  # each env's own sequence (workers may interleave differently)
            steps = min(len(expected[i]), len(got[i]))
            assert steps >= 2 and expected[i][:steps] == got[i][:steps], i
        # Rows that are not consecutive (envs 0 and 2): a copy, whatever copy= says.
        rows = np.array([0, 2])
        assert not np.shares_memory(
            views._exchange._read.observations(rows, False), views._batch.observations
        )


def test_copy_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="copy must be True or False, got 'no'"):
        envfleet.make("CartPole-v1", 2, backend="serial", copy="no")  # type: ignore[arg-type]


class NeedsResetEnv(FaultyEnv):
    """A custom env (no ``gymnasium.make``, so no OrderEnforcing) whose ``step`` breaks before a
    first ``reset``, as many do."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.started  # noqa: B018 - set by reset: an AttributeError before it
        return super().step(action)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        self.started = True
        return super().reset(**kwargs)


def check_step_before_reset_is_refused(pool: envfleet.Pool) -> None:
    """step/send before the first reset raise Gymnasium's ResetNeeded, nothing is sent, and the
    pool then runs as SyncVectorEnv does."""
    actions = np.ones(pool.num_envs, dtype=np.int64)
    attempts = {
        "step": lambda: pool.step(actions),
        "send": lambda: pool.send(actions),
        "step_async": lambda: pool.step_async(actions),
        "send(env_id)": lambda: pool.send(actions[:2], env_id=[0, 1]),
    }
    for name, attempt in attempts.items():
        with pytest.raises(gymnasium.error.ResetNeeded, match="not been reset") as info:
            attempt()
        assert isinstance(info.value, envfleet.PoolStateError), name
    reference = SyncVectorEnv([NeedsResetEnv] * pool.num_envs)
    got, want = pool.reset(seed=3), reference.reset(seed=3)
    np.testing.assert_array_equal(got[0], want[0])
    for _ in range(3):
        got, want = pool.step(actions), reference.step(actions)
        for a, b in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(a, b)
    reference.close()
    pool.close()


def test_step_before_reset_is_refused(backend: str) -> None:
    check_step_before_reset_is_refused(
        envfleet.make(
            NeedsResetEnv, 4, backend=backend, num_workers=2 if backend != "serial" else None
        )
    )
