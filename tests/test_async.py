"""Async send/recv: nothing lost or duplicated, same content as sync, stragglers stall nothing."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from tests.envs import FaultyEnv
from tests.gates import wait_for_file

ASYNC_BACKENDS = ("serial", "thread", "process")


@pytest.mark.parametrize("kind", ASYNC_BACKENDS)
def test_every_env_returned_exactly_once_per_action(kind: str) -> None:
    """10,000 random send/recv rounds over several batch sizes: no result lost or duplicated."""
    rng = np.random.default_rng(0)
    rounds = 0
    for batch_size in (1, 3, 5, 8):
        with envfleet.make(
            FaultyEnv, 8, backend=kind, num_workers=3, batch_size=batch_size, seed=1
        ) as pool:
            sent = np.zeros(8, dtype=np.int64)  # actions (or resets) sent per env
            returned = np.zeros(8, dtype=np.int64)
            owed: set[int] = set(range(8))
            pool.async_reset()
            sent += 1
            for _ in range(2_500):
                obs, rewards, _, _, infos = pool.recv()
                ids = infos["env_id"]
                assert len(ids) == batch_size == len(obs) == len(rewards)
                assert len(set(ids.tolist())) == batch_size, "an env returned twice in a batch"
                assert set(ids.tolist()) <= owed, "an env returned without an action in flight"
                owed -= set(ids.tolist())
                returned[ids] += 1
                # Send to a random subset of the idle envs (at least enough to fill a batch).
                idle = np.array(sorted(set(range(8)) - owed))
                need = max(0, batch_size - len(owed))
                k = int(rng.integers(need, len(idle) + 1)) if len(idle) else 0
                chosen = rng.choice(idle, size=k, replace=False) if k else np.array([], int)
                if k:
                    pool.send(rng.integers(0, 3, size=k), chosen)
                    sent[chosen] += 1
                    owed |= set(chosen.tolist())
                rounds += 1
            # Drain: every action sent has exactly one result.
            while len(owed) >= batch_size:
                ids = pool.recv()[4]["env_id"]
                owed -= set(ids.tolist())
                returned[ids] += 1
            assert (sent - returned == np.isin(np.arange(8), list(owed))).all()
    assert rounds == 10_000


RUN_AHEAD = 8
"""How far (times the steps) an env may run ahead of the slowest in the async runs."""


def _trajectories_sync(mode: AutoresetMode, plan: np.ndarray) -> list[list[tuple[Any, ...]]]:
    """Per-env (obs, reward, terminated, truncated) sequences stepping all envs together."""
    n, steps = plan.shape
    out: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    with envfleet.make("CartPole-v1", n, backend="serial", seed=5, autoreset_mode=mode) as pool:
        obs, _ = pool.reset()
        for i in range(n):
            out[i].append((obs[i].copy(), None, None, None))
        for k in range(steps):
            obs, rew, term, trunc, _ = pool.step(plan[:, k])
            for i in range(n):
                out[i].append((obs[i].copy(), rew[i], term[i], trunc[i]))
            if mode is AutoresetMode.DISABLED and (term | trunc).any():
                obs, _ = pool.reset(options={"reset_mask": term | trunc})
                for i in np.flatnonzero(term | trunc):
                    out[i].append((obs[i].copy(), None, None, None))
    return out


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
@pytest.mark.parametrize("kind", ("thread", "process"))
def test_async_changes_order_never_content(kind: str, mode: AutoresetMode) -> None:
    n, steps, batch_size = 6, 60, 2
    # Envs that run ahead of the slowest (a worker scheduled more often on a loaded machine) keep
    # stepping, up to RUN_AHEAD times the steps, until every env has taken them.
    plan = np.random.default_rng(3).integers(0, 2, size=(n, RUN_AHEAD * steps))
    expected = _trajectories_sync(mode, plan)
    got = _trajectories_async(kind, mode, plan, batch_size, steps)
    for i in range(n):
        m = min(len(expected[i]), len(got[i]))
        assert m > steps // 2
        for k in range(m):
            e, g = expected[i][k], got[i][k]
            np.testing.assert_array_equal(g[0], e[0], err_msg=f"env {i} item {k} obs")
            assert g[1:] == e[1:], f"env {i} item {k}: {g[1:]} != {e[1:]}"


def _trajectories_async(
    kind: str, mode: AutoresetMode, plan: np.ndarray, batch_size: int, steps: int
) -> list[list[tuple[Any, ...]]]:
    n, most = plan.shape
    out: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    k = np.zeros(n, dtype=np.int64)  # actions taken per env
    with envfleet.make(
        "CartPole-v1",
        n,
        backend=kind,
        num_workers=3,
        batch_size=batch_size,
        seed=5,
        autoreset_mode=mode,
    ) as pool:
        pool.async_reset()
        was_reset = np.ones(n, dtype=bool)
        while k.min() < steps:
            obs, rew, term, trunc, infos = pool.recv()
            ids = infos["env_id"]
            for j, i in enumerate(ids):
                if was_reset[i]:
                    out[i].append((obs[j].copy(), None, None, None))
                else:
                    out[i].append((obs[j].copy(), rew[j], term[j], trunc[j]))
            to_reset = [
                i
                for j, i in enumerate(ids)
                if mode is AutoresetMode.DISABLED and not was_reset[i] and (term[j] or trunc[j])
            ]
            to_step = [i for i in ids if i not in to_reset and k[i] < most and k.min() < steps]
            was_reset[ids] = False
            if to_reset:
                pool.async_reset(env_id=to_reset)
                was_reset[to_reset] = True
            if to_step:
                pool.send(plan[to_step, k[to_step]], to_step)
                k[to_step] += 1
            owed = pool._ledger.owed()
            if owed < batch_size:
                break
    return out


def _straggler_pool(kind: str, gate: Path) -> envfleet.Pool:
    hook = functools.partial(wait_for_file, path=str(gate), env_seed=100)
    return envfleet.make(
        functools.partial(FaultyEnv, step_hook=hook),
        4,
        backend=kind,
        num_workers=4,
        batch_size=2,
        seed=100,  # env 0 is reset with seed 100: the straggler
    )


@pytest.mark.parametrize("kind", ("thread", "process"))
def test_straggler_blocks_nothing_but_itself(kind: str, tmp_path: Path) -> None:
    gate = tmp_path / "release"
    with _straggler_pool(kind, gate) as pool:
        pool.reset()
        pool.send(np.ones(4, dtype=np.int64))
        # Env 0 blocks until the gate file exists: the others keep coming back, round after round.
        for _ in range(20):
            ids = pool.recv()[4]["env_id"]
            assert 0 not in ids.tolist()
            pool.send(np.ones(2, dtype=np.int64), ids)
        gate.touch()
        # Once released, the straggler comes back (the per-test timeout bounds this loop).
        while 0 not in (ids := pool.recv()[4]["env_id"]).tolist():
            pool.send(np.ones(2, dtype=np.int64), ids)


@pytest.mark.parametrize("kind", ("thread", "process"))
def test_state_machine_errors(kind: str) -> None:
    with envfleet.make(FaultyEnv, 4, backend=kind, num_workers=2, batch_size=2) as pool:
        with pytest.raises(envfleet.NoPendingError, match="send"):
            pool.recv()
        with pytest.raises(envfleet.NoPendingError, match="batch_size=2"):
            pool.step(np.zeros(1, dtype=np.int64), [3])  # too few for a batch: nothing sent
        assert pool._ledger.owed() == 0
        pool.async_reset()
        with pytest.raises(envfleet.AlreadyPendingError, match=r"envs \[0\] already have"):
            pool.send(np.zeros(1, dtype=np.int64), [0])
        ids = pool.recv()[4]["env_id"]
        with pytest.raises(ValueError, match="out of range"):
            pool.send(np.zeros(1, dtype=np.int64), [4])
        with pytest.raises(ValueError, match="repeats"):
            pool.send(np.zeros(2, dtype=np.int64), [ids[0], ids[0]])
        with pytest.raises(ValueError, match=r"shape \(2,\)"):
            pool.send(np.zeros(3, dtype=np.int64), ids)
        pool.send(np.zeros(2, dtype=np.int64), ids)
        pool.recv()
        with pytest.raises(envfleet.AlreadyPendingError, match="reset"):
            pool.reset()
    with pytest.raises(envfleet.ClosedPoolError):
        pool.send(np.zeros(2, dtype=np.int64), [0, 1])
    with pytest.raises(envfleet.ClosedPoolError):
        pool.recv()


def test_idle_workers_burn_no_cpu() -> None:
    with envfleet.make("CartPole-v1", 8, backend="process", num_workers=2) as pool:
        pool.reset(seed=0)
        for _ in range(20):
            pool.step(np.zeros(8, dtype=np.int64))
        workers = [p for p in psutil.Process(os.getpid()).children() if p.is_running()]
        assert len(workers) == 2
        before = sum(sum(w.cpu_times()[:2]) for w in workers)
        time.sleep(1.0)
        after = sum(sum(w.cpu_times()[:2]) for w in workers)
        assert after - before < 0.05, f"idle workers used {after - before:.3f}s of CPU in 1s"
