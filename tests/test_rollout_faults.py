"""Failures while a rollout is out, on the process backend (node sub-pools: test_rollout_nodes).

A worker SIGKILLed mid-rollout (a marker its env writes says the rollout is under way):
``on_error="raise"`` raises ``WorkerDiedError`` naming the worker and its envs, and the pool is
broken, as after a failed step; ``"restart"`` replaces it, and its part comes back whole, run
again from its rebuilt envs (truncated and flagged at the first step), every action chosen by the
version sent, every env-step counted once. ``close()`` with a rollout out is bounded; a real
Ctrl-C during ``rollout_wait`` interrupts it at once and the pool then closes cleanly.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import envfleet
from tests import timing
from tests.envs import FaultyEnv
from tests.faults import SEED
from tests.test_weights_memory import segments_held, worker_pids

N, WORKERS = 6, 3
VICTIM_WORKER = 1  # envs 2 and 3
SLOW = 0.02
"""Seconds a step of the slow envs takes: a rollout of :data:`STEPS` takes 0.6 s a worker."""
STEPS = 30
MARK_AT = 4
"""The victim's env writes its marker at this step of the second rollout (after two steps)."""


class Shift:
    """``action = (count + shift) % 3`` (the counter env's reward is its action), with 64 KiB of
    weights apart from its code: each version's go through a segment of shared memory."""

    def __init__(self, shift: int) -> None:
        self.shift = np.array([shift])
        self.pad = np.zeros(1 << 13)

    def weights(self) -> dict[str, np.ndarray]:
        return {"shift": self.shift, "pad": self.pad}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.shift, self.pad = weights["shift"], weights["pad"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.asarray((np.asarray(observations)[:, 0] + self.shift[0]) % 3, dtype=np.int64)


def mark(path: str, count: int, env: FaultyEnv, action: Any) -> None:
    """A step hook: the env whose counter reaches ``count`` writes its process id to ``path``
    (counters start at ``seed * 100``: one env of the pool reaches it)."""
    if env.count + 1 == count:
        Path(path).write_text(str(os.getpid()))


def await_marker(path: Path, within: float) -> int:
    """The process id the marker holds, once written."""
    deadline = time.monotonic() + within
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the rollout never reached the marked step"
        time.sleep(0.01)
    return int(path.read_text())


def slow_envs(marker: Path, victim: int, n: int = N) -> list[Any]:
    """``n`` slow counter envs (episodes never end: counters go on); env ``victim`` marks the
    rollout's :data:`MARK_AT`-th step."""
    at = (SEED + victim) * 100 + 2 + MARK_AT
    hook = functools.partial(mark, str(marker), at)
    return [
        functools.partial(FaultyEnv, step_hook=hook, sleep=SLOW, episode_length=10**9)
        for _ in range(n)
    ]


LOST = np.isin(np.arange(N), [2, 3])
"""The victim worker's envs (:data:`VICTIM_WORKER`; the victim env, 2, is one)."""


def victim_pool(marker: Path, **kwargs: Any) -> envfleet.Pool:
    """:func:`slow_envs` on :data:`WORKERS` workers, env 2 marking the rollout."""
    return envfleet.make(slow_envs(marker, victim=2), num_workers=WORKERS, seed=0, **kwargs)


def start_then_kill(
    pool: envfleet.Pool, policy: Shift, marker: Path, pid: int | None, queued: bool = False
) -> None:
    """Version 1 (with its code) whole, then version 2 (weights only) out (``queued``: and
    another part of it queued behind); once the marker says it is under way, SIGKILL ``pid``
    (else the process that wrote the marker)."""
    pool.reset(seed=SEED)
    assert pool.rollout(policy, 2).steps == 2
    policy.shift = np.array([2])
    assert pool.rollout_async(policy, STEPS) == 2
    if queued:
        assert pool.rollout_async(policy, STEPS, queue=True) == 2
    written = await_marker(marker, timing.bound(10.0, pools=4))
    os.kill(written if pid is None else pid, signal.SIGKILL)


def assert_restarted_part(
    got: envfleet.Rollout,
    lost: np.ndarray,
    before: np.ndarray,
    version: int = 2,
    shift: int = 2,
    stood: range = range(MARK_AT - 1, STEPS),
) -> None:
    """Every env's ``STEPS`` steps, chosen by ``version`` (actions shifted by ``shift``); the
    lost envs truncated and flagged at the first step, their latest observation standing with
    it (``stood``: how many of the lost part's steps it is past ``before``), reset by the next
    (``NEXT_STEP``), then counting anew; the others going on from ``before`` untouched."""
    kept = ~lost
    assert got.env_ids.tolist() == list(range(len(lost))) and got.steps == STEPS
    assert (got.policy_versions == version).all()
    counts = got.observations[:, :, 0]
    np.testing.assert_array_equal(got.actions, (counts + shift) % 3)  # its own, every step
    np.testing.assert_array_equal(got.truncations[0], lost)
    np.testing.assert_array_equal(got.infos[0]["_envfleet/restarted"], lost)
    assert not got.truncations[1:].any() and not got.terminations.any()
    assert (got.rewards[:2, lost] == 0).all()  # the truncation, then the autoreset step
    np.testing.assert_array_equal(got.rewards[2:, lost], got.actions[2:, lost])
    np.testing.assert_array_equal(got.rewards[:, kept], got.actions[:, kept])
    np.testing.assert_array_equal(counts[0, kept], before[kept])
    np.testing.assert_array_equal(counts[1, lost], counts[0, lost])  # the latest stands
    anew = counts[2:, lost] - counts[2, lost]
    np.testing.assert_array_equal(anew, np.tile(np.arange(STEPS - 2), (lost.sum(), 1)).T)
    went_on = counts[:, kept] - before[kept]
    np.testing.assert_array_equal(went_on, np.tile(np.arange(STEPS), (kept.sum(), 1)).T)
    # The lost envs' first row is their latest observation, standing with the truncation as
    # after a worker lost mid-step. On one machine, where the killed worker's last step left
    # it in shared memory (the marked step at least: ``stood``'s default; those steps are
    # lost: uncounted, never handed over).
    taken = counts[0, lost] - before[lost]
    assert np.isin(taken, stood).all(), taken


def test_a_worker_killed_mid_rollout_restarts_its_part_counted_once(tmp_path: Path) -> None:
    marker, lost = tmp_path / "marker", LOST
    with victim_pool(marker, on_error="restart") as pool:
        policy = Shift(1)
        victim = worker_pids(pool)[VICTIM_WORKER]
        start_then_kill(pool, policy, marker, None)
        before = pool.stats()
        counts = (SEED + np.arange(N)) * 100 + 2
        assert await_marker(marker, 0) == victim
        got = pool.rollout_wait()
        after = pool.stats()
        assert_restarted_part(got, lost, counts)
        np.testing.assert_array_equal(pool.restarts, lost.astype(np.int64))
        assert after.steps - before.steps == N * STEPS  # each env-step once: none twice
        ended = int((got.terminations | got.truncations).sum())
        assert after.episodes - before.episodes == ended
        assert after.rollout_lags == {0: 2 * WORKERS}  # each part handed over once
        assert worker_pids(pool)[VICTIM_WORKER] != victim
        obs = pool.step(np.zeros(N, dtype=np.int64))[0]  # the pool goes on from there
        np.testing.assert_array_equal(obs[:, 0], got.final_observations[:, 0] + 1)
    assert segments_held() == 0


def test_a_worker_killed_mid_rollout_raises_naming_it(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with victim_pool(marker) as pool:
        start_then_kill(pool, Shift(1), marker, None)
        with pytest.raises(envfleet.WorkerDiedError) as caught:
            pool.rollout_wait()
        error = caught.value
        assert (error.worker, error.phase, error.env_ids) == (1, envfleet.Phase.STEP, (2, 3))
        assert "worker 1" in str(error) and error.exitcode == -signal.SIGKILL
        with pytest.raises(envfleet.BrokenPoolError):
            pool.step(np.zeros(N, dtype=np.int64))
        with pytest.raises(envfleet.BrokenPoolError):
            pool.rollout_wait()
        started = time.monotonic()
    assert time.monotonic() - started < timing.bound(5.0, pools=2)
    assert segments_held() == 0


def test_close_with_a_slow_rollout_out_is_bounded_and_leaves_nothing(tmp_path: Path) -> None:
    """Workers busy with a rollout of 20 s close within ``close``'s timeout; nothing is left
    (the leak check: no process, no ``/dev/shm`` entry; no segment held)."""
    pool = envfleet.make(slow_envs(tmp_path / "marker", victim=0), num_workers=WORKERS, seed=0)
    pool.reset(seed=SEED)
    pool.rollout_async(Shift(1), 1000)
    await_marker(tmp_path / "marker", timing.bound(10.0, pools=4))
    started = time.monotonic()
    pool.close(timeout=1.0)
    assert time.monotonic() - started < timing.bound(5.0, pools=2)
    assert segments_held() == 0
    with pytest.raises(envfleet.ClosedPoolError):
        pool.rollout_wait()


CTRL_C_SCRIPT = """
import functools, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's process has it
import psutil
import envfleet
from tests.envs import FaultyEnv
from tests.test_rollout_faults import Shift
pool = envfleet.make([functools.partial(FaultyEnv, sleep=0.05)] * 4, num_workers=2, seed=0)
pool.reset()
pool.rollout_async(Shift(1), 1000)  # 50 s a worker
print("waiting", flush=True)
try:
    pool.rollout_wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    started = time.monotonic()
    pool.close(timeout=1.0)
    print("closed after", round(time.monotonic() - started, 2), flush=True)
    alive = [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
    helpers = ("forkserver", "resource_tracker")  # multiprocessing's own, for the process
    print("left", [p.pid for p in alive if not any(h in " ".join(p.cmdline()) for h in helpers)])
    sys.exit(0)
sys.exit(3)
"""


def test_ctrl_c_during_rollout_wait_interrupts_it_and_the_pool_closes() -> None:
    """A real SIGINT to the process group (a terminal's Ctrl-C: the workers get it too and
    ignore it), with Python's own handler (a test runner's worker may ignore SIGINT)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)  # inside rollout_wait's wait
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stdout.readline().strip() == "interrupted"
        interrupted = time.monotonic() - sent
        out, _ = proc.communicate(timeout=timing.bound(15.0, pools=4))
        assert proc.returncode == 0, out
        assert interrupted < timing.bound(2.0, pools=1)
        lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
        assert float(lines["closed"].split()[-1]) < timing.bound(5.0, pools=2)
        assert lines["left"] == "[]"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
