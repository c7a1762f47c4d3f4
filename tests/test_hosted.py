"""Hosted VectorEnvs: a worker steps a batched simulator for its block of envs.

The oracle: a pool hosting VectorEnvs gives exactly what the same VectorEnvs give alone
(observations, rewards, flags, infos, autoreset), on every backend; a hosted VectorEnv that
raises is rebuilt whole (its envs flagged), or named; a worker that dies is rebuilt.
"""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

import envfleet
from envfleet.hosted import unbatch_infos
from envfleet.infos import merge_infos

STEPS = 120


class CountingVectorEnv(VectorEnv[Any, Any, Any]):
    """A numpy vector env with infos that have masks and a nested dict: env ``j`` of the
    batch counts up from its seed; episodes of ``length`` steps end truncated (NEXT_STEP);
    ``fail_at``: its step raises on that call (once per instance); ``exit_at``: its process
    exits on that call, once (a marker file)."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int,
        length: int = 7,
        fail_at: int | None = None,
        exit_at: tuple[int, str] | None = None,
    ) -> None:
        self.num_envs = num_envs
        self.single_observation_space = spaces.Box(0, 10**9, (2,), np.int64)
        self.single_action_space = spaces.Discrete(3)
        self.observation_space = gymnasium.vector.utils.batch_space(
            self.single_observation_space, num_envs
        )
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, num_envs)
        self.length, self.fail_at, self.exit_at = length, fail_at, exit_at
        self.calls = 0
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.base = np.zeros(num_envs, dtype=np.int64)
        self.ended = np.zeros(num_envs, dtype=bool)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> Any:
        seeds = np.broadcast_to(np.asarray(0 if seed is None else seed), (self.num_envs,))
        mask = (options or {}).get("reset_mask", np.ones(self.num_envs, dtype=bool))
        self.base[mask] = seeds[mask] * 1000
        self.t[mask] = 0
        self.ended[mask] = False
        return self._obs(), {"seeded": seeds.copy(), "_seeded": mask.copy()}

    def step(self, actions: Any) -> Any:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError(f"the batched simulator broke on call {self.calls}")
        exiting = self.exit_at is not None and self.calls == self.exit_at[0]
        if exiting and self.exit_at is not None and not os.path.exists(self.exit_at[1]):
            open(self.exit_at[1], "w").close()
            os._exit(3)
        actions = np.asarray(actions)
        rewards = np.where(self.ended, 0.0, actions.astype(np.float32) / 2).astype(np.float32)
        self.base[self.ended] += 100
        self.t[self.ended] = 0
        self.t[~self.ended] += 1 + actions[~self.ended]
        truncations = ~self.ended & (self.t >= self.length)
        was_ended, self.ended = self.ended, truncations.copy()
        infos: dict[str, Any] = {
            "odd": self.t % 2 == 1,
            "_odd": self.t % 2 == 1,
            "episode": {"t": self.t.copy(), "_t": truncations.copy()},
            "_episode": truncations.copy(),
        }
        if was_ended.any():
            infos["reset_now"], infos["_reset_now"] = was_ended.copy(), was_ended.copy()
        terminations = np.zeros(self.num_envs, dtype=bool)
        return self._obs(), rewards, terminations, truncations, infos

    def _obs(self) -> np.ndarray:
        return np.stack([self.base + self.t, self.t], axis=1)


def counting(num_envs: int, **kwargs: Any) -> VectorEnv[Any, Any, Any]:
    return CountingVectorEnv(num_envs, **kwargs)


def run(env: Any, sizes: list[int], seed: int, steps: int = STEPS, choices: int = 3) -> list[Any]:
    """Reset with ``seed`` then ``steps`` steps of fixed actions: every field, and infos."""
    n = sum(sizes)
    actions = np.random.default_rng(1).integers(0, choices, size=(steps, n))
    obs, infos = env.reset(seed=seed)
    out: list[Any] = [obs, infos]
    for a in actions:
        out.extend(env.step(a))
    return out


class Alone:
    """The same VectorEnvs, alone, side by side: what the pool must give (its infos merged
    from each one's, Gymnasium's way)."""

    def __init__(self, venvs: list[Any]) -> None:
        self.venvs = venvs
        self.sizes = [v.num_envs for v in venvs]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).tolist()

    def _merge(self, parts: list[Any]) -> Any:
        blocks = zip(self.starts, self.sizes, strict=True)
        pairs = [
            (info, start + j)
            for (start, size), got in zip(blocks, parts, strict=True)
            for j, info in unbatch_infos(got, size).items()
        ]
        return merge_infos(pairs, sum(self.sizes))

    def reset(self, seed: int) -> Any:
        """``seed + i`` for each env where the VectorEnv takes a seed per env, else its first
        env's (Gymnasium's numpy vector envs): what the pool gives them."""
        outs = []
        for venv, start, size in zip(self.venvs, self.starts, self.sizes, strict=True):
            try:
                outs.append(venv.reset(seed=np.arange(seed + start, seed + start + size)))
            except gymnasium.error.Error:
                outs.append(venv.reset(seed=seed + start))
        return np.concatenate([o for o, _ in outs]), self._merge([i for _, i in outs])

    def step(self, actions: np.ndarray) -> Any:
        outs = [
            v.step(actions[s : s + n])
            for v, s, n in zip(self.venvs, self.starts, self.sizes, strict=True)
        ]
        obs, rew, te, tr = (np.concatenate([o[k] for o in outs]) for k in range(4))
        return obs, rew.astype(np.float64), te, tr, self._merge([o[4] for o in outs])


def assert_same(want: list[Any], got: list[Any]) -> None:
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        if isinstance(x, dict):
            assert x.keys() == y.keys(), f"item {k}: info keys {sorted(x)} != {sorted(y)}"
            assert_same([x[key] for key in sorted(x)], [y[key] for key in sorted(x)])
            continue
        np.testing.assert_array_equal(x, y, err_msg=f"item {k}")
        assert np.asarray(x).dtype == np.asarray(y).dtype, f"item {k}: dtype"


@pytest.mark.parametrize("workers", [1, 2])
def test_cartpoles_vector_entry_point_hosted_is_the_vector_env_alone(
    backend: str, workers: int
) -> None:
    n = 8
    blocks = 1 if backend == "serial" else workers
    alone = Alone(
        [
            gymnasium.make_vec("CartPole-v1", n // blocks, vectorization_mode="vector_entry_point")
            for _ in range(blocks)
        ]
    )
    want = run(alone, alone.sizes, seed=5, steps=300, choices=2)  # episodes end on the way
    with envfleet.make(
        "CartPole-v1",
        n,
        backend=backend,
        num_workers=workers,
        seed=5,
        vectorization_mode="vector_entry_point",
    ) as pool:
        got = run(pool, alone.sizes, seed=5, steps=300, choices=2)
    assert any(np.asarray(x).dtype == bool and np.asarray(x).any() for x in want[4::5])
    assert_same(want, got)


def test_vector_env_fns_of_several_sizes_give_each_ones_values_and_infos(backend: str) -> None:
    fns = [functools.partial(counting, 3), functools.partial(counting, 5, length=4)]
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=11)
    with envfleet.make(vector_env_fns=fns, backend=backend, seed=11) as pool:
        assert pool.num_envs == 8 and pool.num_workers == (1 if backend == "serial" else 2)
        got = run(pool, alone.sizes, seed=11)
        values = pool.get_attr("length")
    assert_same(want, got)
    assert values == (7, 7, 7, 4, 4, 4, 4, 4)


def test_async_batches_are_whole_blocks_and_match_each_blocks_own_steps() -> None:
    fns = [functools.partial(counting, 2)] * 3
    with envfleet.make(vector_env_fns=fns, backend="process", batch_size=2, seed=0) as pool:
        pool.async_reset()
        seen: dict[int, list[Any]] = {}
        for _ in range(30):
            obs, *_, infos = pool.recv()
            ids = infos["env_id"]
            assert len(ids) == 2 and ids[0] % 2 == 0 and ids[1] == ids[0] + 1
            for j, i in enumerate(ids):
                seen.setdefault(int(i), []).append(obs[j].copy())
            pool.send(np.ones(2, dtype=np.int64), ids)
    alone = CountingVectorEnv(2)
    for block in range(3):
        obs, _ = alone.reset(seed=np.arange(2 * block, 2 * block + 2))
        want = [obs.copy()]
        for _ in range(len(seen[2 * block]) - 1):
            want.append(alone.step(np.ones(2, dtype=np.int64))[0].copy())
        for j in range(2):
            np.testing.assert_array_equal(np.array(seen[2 * block + j]), np.array(want)[:, j])


def test_a_hosted_env_that_raises_is_rebuilt_whole_and_only_its_envs_are_flagged() -> None:
    fns = [functools.partial(counting, 3), functools.partial(counting, 2, fail_at=4)]
    with envfleet.make(vector_env_fns=fns, backend="process", seed=0, on_error="restart") as pool:
        obs, _ = pool.reset()
        healthy = CountingVectorEnv(3)
        healthy.reset(seed=np.arange(3))
        actions = np.ones(5, dtype=np.int64)
        for step in range(1, 7):
            last = obs.copy()
            obs, rewards, _, truncations, infos = pool.step(actions)
            np.testing.assert_array_equal(obs[:3], healthy.step(actions[:3])[0])
            if step == 4:  # the block of envs 3-4 broke: flagged, its last observation kept
                assert infos["_envfleet/restarted"].tolist() == [False] * 3 + [True] * 2
                assert truncations[3:].all() and (rewards[3:] == 0).all()
                np.testing.assert_array_equal(obs[3:], last[3:])
            elif step == 5:  # then its first result: the rebuilt env's reset
                assert "envfleet/restarted" not in infos
                assert (obs[3:, 1] == 0).all() and not truncations[3:].any()
            else:
                assert "envfleet/restarted" not in infos
        assert pool.restarts.tolist() == [0, 0, 0, 1, 1]


def test_a_hosted_env_that_raises_under_raise_names_its_block() -> None:
    fns = [functools.partial(counting, 3), functools.partial(counting, 2, fail_at=2)]
    with envfleet.make(vector_env_fns=fns, backend="thread", seed=0) as pool:
        pool.reset()
        pool.step(np.zeros(5, dtype=np.int64))
        with pytest.raises(envfleet.EnvRaisedError, match="broke on call 2") as info:
            pool.step(np.zeros(5, dtype=np.int64))
        assert info.value.env_index == 3 and info.value.worker == 1
        assert info.value.phase is envfleet.Phase.STEP


def test_a_worker_hosting_a_vector_env_that_dies_is_rebuilt(tmp_path: Any) -> None:
    marker = str(tmp_path / "died")
    fns = [functools.partial(counting, 2), functools.partial(counting, 2, exit_at=(3, marker))]
    with envfleet.make(
        vector_env_fns=fns, backend="process", seed=0, on_error="restart", step_timeout=30
    ) as pool:
        pool.reset()
        flagged = np.zeros(4, dtype=bool)
        for _ in range(5):
            _, _, _, truncations, infos = pool.step(np.ones(4, dtype=np.int64))
            if "envfleet/restarted" in infos:
                flagged |= infos["_envfleet/restarted"]
                assert truncations[infos["_envfleet/restarted"]].all()
        assert os.path.exists(marker)
        assert flagged.tolist() == [False, False, True, True]


def test_what_a_hosted_pool_cannot_do_is_refused_before_anything_starts() -> None:
    fn = functools.partial(counting, 2)
    with pytest.raises(ValueError, match="autoreset mode is NextStep"):
        envfleet.make(vector_env_fns=[fn], backend="serial", autoreset_mode="SameStep")
    with pytest.raises(ValueError, match="threads_per_worker"):
        envfleet.make(vector_env_fns=[fn, fn], backend="thread", threads_per_worker=2)
    with pytest.raises(ValueError, match="batch_size=3"):
        envfleet.make(vector_env_fns=[fn, fn], backend="thread", batch_size=3)
    with pytest.raises(ValueError, match="num_envs=5"):
        envfleet.make(vector_env_fns=[fn, fn], num_envs=5, backend="thread")
    with pytest.raises(TypeError, match="registered env id"):
        envfleet.make(gymnasium.make, 2, vectorization_mode="vector_entry_point")
    with pytest.raises(ValueError, match="no vector entry point"):
        envfleet.make("FrozenLake-v1", 2, backend="serial", vectorization_mode="vector_entry_point")
    with pytest.raises(TypeError, match=r"gymnasium\.vector\.VectorEnv"):
        envfleet.make(vector_env_fns=[lambda: gymnasium.make("CartPole-v1")], backend="serial")


def test_a_rollout_on_hosted_vector_envs_is_the_same_steps() -> None:
    fns = [functools.partial(counting, 2), functools.partial(counting, 3, length=3)]
    with envfleet.make(vector_env_fns=fns, backend="process", seed=4) as pool:
        pool.reset()
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=0)
        out = pool.rollout(policy, 12)
    alone = Alone([fn() for fn in fns])
    obs, _ = alone.reset(seed=4)
    for t in range(12):
        np.testing.assert_array_equal(out.observations[t], obs, err_msg=f"step {t}")
        obs, rewards, _, truncations, _ = alone.step(out.actions[t])
        np.testing.assert_array_equal(out.rewards[t], rewards)
        np.testing.assert_array_equal(out.truncations[t], truncations)


def atari(num_envs: int) -> VectorEnv[Any, Any, Any]:
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv("pong", num_envs, num_threads=1)


@pytest.mark.parametrize("where", ["serial", "process"])
def test_ale_pys_atari_vector_env_hosted_is_the_vector_env_alone(where: str) -> None:
    """ale-py's C++ ``AtariVectorEnv``: a seed per env, frames and infos as alone (serial: one
    worker hosts both, stepped through their ``send``/``recv``, side by side)."""
    fns = [functools.partial(atari, 2), functools.partial(atari, 2)]
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=3, steps=40)
    for venv in alone.venvs:
        venv.close()
    with envfleet.make(vector_env_fns=fns, backend=where, seed=3) as pool:
        got = run(pool, alone.sizes, seed=3, steps=40)
    assert want[0].dtype == np.uint8 and want[0].shape == (4, 4, 84, 84)
    assert_same(want, got)


def test_envfleet_run_hosts_the_envs_vector_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    """``envfleet run --vectorization-mode vector_entry_point``: a worker per hosted block,
    episodes counted from the hosted env's flags; a mode it does not know is a usage error."""
    import json

    from envfleet.cli import main

    argv = ["run", "CartPole-v1", "--backend", "thread", "--num-envs", "8", "--steps", "4000"]
    argv += ["--num-workers", "2", "--json"]
    assert main([*argv, "--vectorization-mode", "vector_entry_point"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["vectorization_mode"] == "vector_entry_point"
    assert summary["num_workers"] == 2 and summary["steps"] == 4000
    assert summary["episodes"] > 50  # CartPole's random episodes last ~22 steps
    assert main([*argv, "--vectorization-mode", "bogus"]) == 2


class SameStepCounting(CountingVectorEnv):
    """:class:`CountingVectorEnv` declaring Gymnasium's SAME_STEP mode (its episodes here
    never end: only the restart of a broken one is looked at)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}


def same_step(num_envs: int, **kwargs: Any) -> VectorEnv[Any, Any, Any]:
    return SameStepCounting(num_envs, length=1000, **kwargs)


def test_a_restart_in_same_step_mode_resets_at_once_with_the_final_observation() -> None:
    fns = [functools.partial(same_step, 2), functools.partial(same_step, 2, fail_at=3)]
    with envfleet.make(
        vector_env_fns=fns, backend="serial", seed=0, on_error="restart", autoreset_mode="SameStep"
    ) as pool:
        obs, _ = pool.reset()
        for _ in range(2):
            last = obs.copy()
            obs, *_ = pool.step(np.ones(4, dtype=np.int64))
        last = obs.copy()
        obs, rewards, terminations, truncations, infos = pool.step(np.ones(4, dtype=np.int64))
        assert infos["_envfleet/restarted"].tolist() == [False, False, True, True]
        assert truncations.tolist() == [False, False, True, True] and not terminations.any()
        assert (rewards[2:] == 0).all() and (obs[2:, 1] == 0).all()  # reset: t = 0
        np.testing.assert_array_equal(np.stack(infos["final_obs"][2:]), last[2:])
        obs, *_ = pool.step(np.ones(4, dtype=np.int64))
        assert (obs[2:, 1] == 2).all()  # stepping on from the reset


class SendingVectorEnv(CountingVectorEnv):
    """A :class:`CountingVectorEnv` with ``send``/``recv`` (``step`` is ``send`` then
    ``recv``), each call written to ``log`` under the env's ``name``; ``send_fails_at``: its
    send raises on that call (once per instance)."""

    def __init__(
        self, num_envs: int, name: str, log: list[str], send_fails_at: int | None = None, **kw: Any
    ) -> None:
        super().__init__(num_envs, **kw)
        self.name, self.log, self.send_fails_at, self.sends = name, log, send_fails_at, 0
        self._actions: Any = None

    def send(self, actions: Any) -> None:
        self.log.append(f"send {self.name}")
        self.sends += 1
        if self.sends == self.send_fails_at:
            raise RuntimeError(f"send {self.sends} of {self.name} broke")
        self._actions = np.array(actions)

    def recv(self) -> Any:
        self.log.append(f"recv {self.name}")
        return super().step(self._actions)

    def step(self, actions: Any) -> Any:
        self.send(actions)
        return self.recv()


@pytest.mark.parametrize("fails", [None, "send_fails_at", "fail_at"])
def test_a_workers_vector_envs_with_send_and_recv_all_get_their_actions_first(
    fails: str | None,
) -> None:
    """Two hosted VectorEnvs with ``send``/``recv`` on one worker: each step sends both their
    actions before waiting for either (so that their threads step side by side), and gives
    what they give alone; the second's fifth ``send`` or ``recv`` raising restarts its block
    only (its envs truncated at that step, the first's envs as alone)."""
    log: list[str] = []
    fns = [
        functools.partial(SendingVectorEnv, 2, "a", log),
        functools.partial(SendingVectorEnv, 3, "b", log, **({fails: 5} if fails else {})),
    ]
    alone = Alone([CountingVectorEnv(2), CountingVectorEnv(3)])
    want = run(alone, alone.sizes, seed=4, steps=12)
    with envfleet.make(
        vector_env_fns=fns, backend="serial", num_workers=1, seed=4, on_error="restart"
    ) as pool:
        log.clear()
        got = run(pool, alone.sizes, seed=4, steps=12)
    assert log[:4] == ["send a", "send b", "recv a", "recv b"], log
    if fails is None:
        assert log == log[:4] * 12, log
        assert_same(want, got)
        return
    truncated_5, infos_5 = got[25], got[26]  # step 5: items 2 + 5 * 4 + 3 and + 4
    assert truncated_5[2:].all() and infos_5["envfleet/restarted"][2:].all()
    assert not infos_5["_envfleet/restarted"][:2].any()
    for k in range(2, len(want)):  # block a's envs: every step as alone
        if not isinstance(want[k], dict):
            np.testing.assert_array_equal(want[k][:2], got[k][:2], err_msg=f"item {k}")


class PlainInfoVectorEnv(CountingVectorEnv):
    """:class:`CountingVectorEnv` whose step infos are Atari's kind: every env holds every key,
    arrays of plain scalars with no ``_key`` mask (kept as arrays and sent as columns)."""

    def step(self, actions: Any) -> Any:
        obs, rewards, terminations, truncations, _ = super().step(actions)
        infos = {
            "lives": (3 - self.t % 3).astype(np.int32),
            "frame": self.base + self.t,
            "score": (self.t / 4).astype(np.float32),
        }
        return obs, rewards, terminations, truncations, infos


def plain_infos(num_envs: int, **kwargs: Any) -> VectorEnv[Any, Any, Any]:
    return PlainInfoVectorEnv(num_envs, **kwargs)


@pytest.mark.parametrize(
    ("mixed", "workers"),
    [(False, 2), (True, 1), (True, 2)],
    ids=["plain", "beside-masked-in-a-worker", "beside-masked-in-another"],
)
def test_plain_array_infos_are_those_of_the_vector_envs_alone(
    backend: str, mixed: bool, workers: int
) -> None:
    """Infos of unmasked arrays (sent as columns, no dict per env) are, key for key and dtype
    for dtype, what the VectorEnvs alone give, one or two to a worker; beside a VectorEnv whose
    infos have masks (in the same worker, or another), each env's own, merged Gymnasium's way;
    and in a rollout, step by step."""
    fns = [functools.partial(plain_infos, 2), functools.partial(plain_infos, 3, length=3)]
    if mixed:
        fns.append(functools.partial(counting, 2))
    layout = {} if backend == "serial" else {"num_workers": workers}  # serial: one worker
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=5)
    with envfleet.make(vector_env_fns=fns, backend=backend, seed=5, **layout) as pool:
        got = run(pool, alone.sizes, seed=5)
        assert_same(want, got)
        assert got[6]["lives"].dtype == np.int32 and got[6]["score"].dtype == np.float32
        out = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, seed=0), 9)
    obs = want[-5]  # where the pool stood: the last step's observations
    for t in range(9):
        np.testing.assert_array_equal(out.observations[t], obs, err_msg=f"step {t}")
        obs, rewards, _, _, infos = alone.step(out.actions[t])
        np.testing.assert_array_equal(out.rewards[t], rewards)
        assert_same([infos], [out.infos[t]])


def test_batched_infos_read_as_unbatched_and_travel_as_the_same_columns() -> None:
    """A VectorEnv's unmasked arrays read as the dicts unbatching gives (values and types),
    pickle, join, and make exactly the columns :func:`info_columns` makes of those dicts;
    anything else (a mask, another length, bools, objects, ``final_obs``) is left to
    unbatching."""
    from envfleet.info_columns import BatchedInfos, info_columns

    arrays = {"lives": np.array([3, 2, 1], np.int32), "frame": np.array([7, 8, 9], np.int64)}
    batched = BatchedInfos.of((4, 5, 6), arrays)
    assert batched is not None
    dicts = {4 + j: info for j, info in unbatch_infos(arrays, 3).items()}
    assert dict(batched) == dicts and batched == dicts and pickle.loads(pickle.dumps(batched))
    assert [type(v) for v in batched[5].values()] == [np.int32, np.int64]
    assert batched.columns() == info_columns(dicts)
    arrays["lives"][0] = 0  # the VectorEnv's next step: the infos kept are their own
    assert batched[4]["lives"] == 3
    more = BatchedInfos.of((7,), {"lives": np.array([5], np.int32), "frame": np.array([1])})
    assert more is not None
    joined = BatchedInfos.join([batched, more])
    assert joined is not None and dict(joined) == {**dicts, 7: more[7]}
    assert joined.columns() == info_columns(dict(joined))
    other = BatchedInfos.of((7,), {"lives": np.array([5], np.int64), "frame": np.array([1])})
    assert other is not None and BatchedInfos.join([batched, other]) is None
    for refused in (
        {"a": np.ones(3), "_a": np.ones(3, bool)},
        {"a": np.ones(2)},
        {"a": np.ones(3, bool)},
        {"a": np.array([None] * 3)},
        {"final_obs": np.ones(3)},
        {"a": [1, 2, 3]},
        {},
    ):
        assert BatchedInfos.of((0, 1, 2), refused) is None, refused
