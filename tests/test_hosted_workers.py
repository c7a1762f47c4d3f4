"""Several hosted VectorEnvs per worker: ``vector_env_fns`` on fewer workers than factories.

The oracle: each worker hosts a contiguous run of the factories' VectorEnvs, and the pool gives
exactly what the same VectorEnvs give alone, side by side (values, dtypes, infos, autoreset),
whatever the number of workers; those with ``send``/``recv`` on one worker each get their
actions before any is waited for; a hosted VectorEnv that raises is rebuilt alone, a worker
that dies has its own blocks rebuilt, and no other.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
from envfleet.hosted import unbatch_infos
from tests.test_hosted import (
    Alone,
    CountingVectorEnv,
    SendingVectorEnv,
    assert_same,
    atari,
    counting,
    run,
)


def cartpoles(num_envs: int) -> Any:
    return gymnasium.make_vec("CartPole-v1", num_envs, vectorization_mode="vector_entry_point")


SIZES = [3, 5, 2, 6]
"""Four CartPole VectorEnvs of different sizes (16 envs)."""


@pytest.mark.parametrize(
    ("where", "workers", "runs"),
    [
        ("process", 1, [16]),
        ("process", 2, [8, 8]),  # blocks 3 + 5 and 2 + 6
        ("process", 3, [8, 2, 6]),  # np.array_split of 4 factories: 2, 1, 1
        ("thread", 2, [8, 8]),
    ],
)
def test_vector_env_fns_on_fewer_workers_are_each_vector_env_alone(
    where: str, workers: int, runs: list[int]
) -> None:
    fns = [functools.partial(cartpoles, n) for n in SIZES]
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=5, steps=300, choices=2)  # episodes end on the way
    with envfleet.make(vector_env_fns=fns, backend=where, num_workers=workers, seed=5) as pool:
        assert pool.num_envs == 16 and pool.num_workers == workers
        assert [len(w.env_ids) for w in pool.stats().workers] == runs
        got = run(pool, alone.sizes, seed=5, steps=300, choices=2)
    assert any(np.asarray(x).dtype == bool and np.asarray(x).any() for x in want[4::5])
    assert_same(want, got)


def test_infos_and_attributes_of_several_vector_envs_per_worker_are_each_ones() -> None:
    fns = [
        functools.partial(counting, 3),
        functools.partial(counting, 5, length=4),
        functools.partial(counting, 2, length=3),
    ]
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=11)
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=2, seed=11) as pool:
        assert [w.env_ids for w in pool.stats().workers] == [tuple(range(8)), (8, 9)]
        got = run(pool, alone.sizes, seed=11)
        assert pool.get_attr("length") == (7,) * 3 + (4,) * 5 + (3,) * 2
    assert_same(want, got)


class FileLog:
    """A log that a worker process appends to (a line per call; ``list``'s ``append``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, line: str) -> None:
        with open(self.path, "a") as out:
            out.write(line + "\n")

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines()


def test_a_worker_process_sends_each_of_its_vector_envs_its_actions_first(
    tmp_path: Path,
) -> None:
    """Two workers of two hosted VectorEnvs with ``send``/``recv`` each: every step sends both
    of a worker's VectorEnvs their actions before waiting for either, and gives what they give
    alone."""
    logs = [FileLog(tmp_path / "worker0"), FileLog(tmp_path / "worker1")]
    names = ["a", "b", "c", "d"]
    sizes = [2, 3, 2, 1]
    fns = [
        functools.partial(SendingVectorEnv, size, name, logs[k // 2])
        for k, (size, name) in enumerate(zip(sizes, names, strict=True))
    ]
    alone = Alone([CountingVectorEnv(size) for size in sizes])
    want = run(alone, alone.sizes, seed=4, steps=12)
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=2, seed=4) as pool:
        got = run(pool, alone.sizes, seed=4, steps=12)
    assert_same(want, got)
    for log, (x, y) in zip(logs, [("a", "b"), ("c", "d")], strict=True):
        step = [f"send {x}", f"send {y}", f"recv {x}", f"recv {y}"]
        assert log.lines() == step * 12, log.lines()


def test_ale_pys_atari_vector_envs_two_per_worker_are_the_vector_envs_alone() -> None:
    """ale-py's C++ ``AtariVectorEnv`` (``send``/``recv``), four on two worker processes:
    a seed per env, frames and infos as alone."""
    fns = [functools.partial(atari, 2)] * 4
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=3, steps=30)
    for venv in alone.venvs:
        venv.close()
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=2, seed=3) as pool:
        got = run(pool, alone.sizes, seed=3, steps=30)
    assert want[0].dtype == np.uint8 and want[0].shape == (8, 4, 84, 84)
    assert_same(want, got)


def test_a_vector_env_that_raises_is_rebuilt_alone_beside_the_others_of_its_worker() -> None:
    """Worker 0 hosts blocks 0 (envs 0-1) and 1 (envs 2-4); block 1 raises on its fourth step:
    only its envs are flagged and counted, every other env steps on as alone."""
    sizes = [2, 3, 2, 2]
    fns = [functools.partial(counting, n) for n in sizes]
    fns[1] = functools.partial(counting, 3, fail_at=4)
    healthy = Alone([CountingVectorEnv(n) for n in sizes])
    others = np.r_[0:2, 5:9]
    with envfleet.make(
        vector_env_fns=fns, backend="process", num_workers=2, seed=0, on_error="restart"
    ) as pool:
        obs, _ = pool.reset()
        want, _ = healthy.reset(seed=0)
        np.testing.assert_array_equal(obs, want)
        actions = np.ones(9, dtype=np.int64)
        for step in range(1, 7):
            last = obs.copy()
            obs, rewards, _, truncations, infos = pool.step(actions)
            want, want_rewards, _, want_truncations, _ = healthy.step(actions)
            np.testing.assert_array_equal(obs[others], want[others], err_msg=f"step {step}")
            np.testing.assert_array_equal(rewards[others], want_rewards[others])
            np.testing.assert_array_equal(truncations[others], want_truncations[others])
            if step == 4:  # block 1 broke: flagged, its last observation kept
                assert infos["_envfleet/restarted"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0]
                assert truncations[2:5].all() and (rewards[2:5] == 0).all()
                np.testing.assert_array_equal(obs[2:5], last[2:5])
            else:
                assert "envfleet/restarted" not in infos
        assert pool.restarts.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0]


def test_a_worker_that_dies_has_its_own_blocks_rebuilt_and_no_other(tmp_path: Path) -> None:
    """Block 1 exits worker 0's process: both blocks of worker 0 (envs 0-3) are rebuilt and
    flagged, worker 1's (envs 4-7) step on."""
    marker = str(tmp_path / "died")
    fns = [functools.partial(counting, 2)] * 4
    fns[1] = functools.partial(counting, 2, exit_at=(3, marker))
    with envfleet.make(
        vector_env_fns=fns,
        backend="process",
        num_workers=2,
        seed=0,
        on_error="restart",
        step_timeout=30,
    ) as pool:
        pool.reset()
        flagged = np.zeros(8, dtype=bool)
        for _ in range(5):
            _, _, _, truncations, infos = pool.step(np.ones(8, dtype=np.int64))
            if "envfleet/restarted" in infos:
                flagged |= infos["_envfleet/restarted"]
                assert truncations[infos["_envfleet/restarted"]].all()
        assert os.path.exists(marker)
        assert flagged.tolist() == [True] * 4 + [False] * 4
        assert pool.restarts.tolist() == [1] * 4 + [0] * 4


def test_async_batches_of_several_vector_envs_per_worker_are_whole_blocks() -> None:
    """Four VectorEnvs of two envs on two workers, ``batch_size=2``: each batch one block,
    each block's observations its own steps alone."""
    fns = [functools.partial(counting, 2)] * 4
    with envfleet.make(
        vector_env_fns=fns, backend="process", num_workers=2, batch_size=2, seed=0
    ) as pool:
        pool.async_reset()
        seen: dict[int, list[Any]] = {}
        for _ in range(40):
            obs, *_, infos = pool.recv()
            ids = infos["env_id"]
            assert len(ids) == 2 and ids[0] % 2 == 0 and ids[1] == ids[0] + 1
            for j, i in enumerate(ids):
                seen.setdefault(int(i), []).append(obs[j].copy())
            pool.send(np.ones(2, dtype=np.int64), ids)
    assert sorted(seen) == list(range(8))
    for block in range(4):
        alone = CountingVectorEnv(2)
        obs, _ = alone.reset(seed=np.arange(2 * block, 2 * block + 2))
        want = [obs.copy()]
        for _ in range(len(seen[2 * block]) - 1):
            want.append(alone.step(np.ones(2, dtype=np.int64))[0].copy())
        for j in range(2):
            np.testing.assert_array_equal(np.array(seen[2 * block + j]), np.array(want)[:, j])


def test_more_workers_than_vector_env_fns_is_refused_naming_the_argument() -> None:
    fns = [functools.partial(counting, 2)] * 2
    with pytest.raises(ValueError, match=r"num_workers=3 exceeds the 2 vector_env_fns"):
        envfleet.make(vector_env_fns=fns, backend="process", num_workers=3)
    with pytest.raises(ValueError, match="num_workers must be at least 1"):
        envfleet.make(vector_env_fns=fns, backend="thread", num_workers=0)


def reference_unbatch(infos: dict[str, Any], n: int) -> dict[int, dict[str, Any]]:
    """Each env's infos, read key by key through its mask (or every env without one)."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get("_" + key, np.ones(n, dtype=bool))
        nested = reference_unbatch(value, n) if isinstance(value, dict) else None
        for j in range(n):
            if mask[j] and nested is None:
                out.setdefault(j, {})[key] = value[j]
            elif mask[j] and nested is not None and j in nested:
                out.setdefault(j, {})[key] = nested[j]
    return dict(sorted(out.items()))


@pytest.mark.parametrize(
    "infos",
    [
        {},
        {"_only_a_mask": np.ones(3, dtype=bool)},
        {"lives": np.array([3, 2, 1], np.int32), "frame": np.arange(3, dtype=np.int64)},
        {"pos": np.arange(6.0).reshape(3, 2), "name": np.array(["a", None, 3], dtype=object)},
        {"lives": np.array([3, 2, 1], np.int32), "t": np.arange(3), "_t": np.array([0, 1, 0])},
        {"episode": {"r": np.arange(3.0), "_r": np.array([1, 0, 1], bool)}, "x": np.ones(3)},
        {"listed": [1, 2, 3]},
    ],
)
def test_a_vector_envs_infos_per_env_are_each_envs_own(infos: dict[str, Any]) -> None:
    """Arrays every env has (no mask: a dict per env filled key by key), masks, nested dicts:
    each env gets what its rows say, of the arrays' own types, in env order."""
    got, want = unbatch_infos(infos, 3), reference_unbatch(infos, 3)
    assert list(got) == list(want)
    for j, info in want.items():
        assert list(got[j]) == list(info)
        assert_same(list(info.values()), list(got[j].values()))
        assert [type(v) for v in got[j].values()] == [type(v) for v in info.values()]


class CastingVectorEnv(CountingVectorEnv):
    """A :class:`CountingVectorEnv` whose observations come as ``dtype`` (its space: int64)."""

    def __init__(self, num_envs: int, dtype: Any) -> None:
        super().__init__(num_envs)
        self.dtype = dtype

    def _obs(self) -> np.ndarray:
        return super()._obs().astype(self.dtype)


def test_hosted_observations_of_another_dtype_are_cast_or_refused_as_gymnasium_does() -> None:
    """int32 observations for an int64 space go in (numpy's same_kind rule); float64 ones are
    refused, naming the block's first env, as SyncVectorEnv refuses them."""
    fns = [functools.partial(counting, 2), functools.partial(CastingVectorEnv, 2, np.int32)]
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=1, seed=1) as pool:
        obs, _ = pool.reset()
        obs, *_ = pool.step(np.ones(4, dtype=np.int64))
    alone = Alone([CountingVectorEnv(2), CountingVectorEnv(2)])
    alone.reset(seed=1)
    assert obs.dtype == np.int64
    np.testing.assert_array_equal(obs, alone.step(np.ones(4, dtype=np.int64))[0])
    fns[1] = functools.partial(CastingVectorEnv, 2, np.float64)
    with envfleet.make(vector_env_fns=fns, backend="process", num_workers=1, seed=1) as pool:
        with pytest.raises(envfleet.EnvRaisedError, match="Cannot cast") as info:
            pool.reset()
        assert info.value.env_index == 2


def test_an_ale_id_is_hosted_without_importing_ale_py_first() -> None:
    """``ALE/...`` ids are registered by importing ale_py, which a fresh process has not done:
    make() imports it for a hosted id as for single envs (its probe, and each worker)."""
    import subprocess
    import sys

    code = (
        "import numpy as np, envfleet\n"
        "with envfleet.make('ALE/Pong-v5', 2, backend='process', num_workers=2, seed=0,\n"
        "                   vectorization_mode='vector_entry_point', context='spawn') as pool:\n"
        "    obs, _ = pool.reset()\n"
        "    print(obs.shape, pool.step(np.zeros(2, dtype=np.int64))[0].shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "(2, 4, 84, 84) (2, 4, 84, 84)" in done.stdout
