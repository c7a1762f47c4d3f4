"""Rollouts on node sub-pools: each version's weights once per node, and failures mid-rollout.

A head and two worker nodes of ``ray.cluster_utils.Cluster``, all on this machine, shared by the
module. Oracles: a version's 10 MB go to each node once (its message) and from there into one
segment of the node's shared memory that its workers map, each reading a few hundred bytes from
its pipe, and the rollouts are the serial backend's; a large part is recorded in the agent's
shared memory, not written down the worker's pipe; a worker SIGKILLed mid-rollout, or a
node's agent, raises ``WorkerDiedError`` naming it (``raise``) or has its part run again from
its rebuilt envs (``restart``), every env-step handed over and counted once; ``close()`` with a
rollout out is bounded and leaves nothing behind (``ray_leak_check``).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import ray
from gymnasium.vector import SyncVectorEnv
from ray.cluster_utils import Cluster

import envfleet
from tests import timing
from tests.envs import FaultyEnv
from tests.faults import SEED
from tests.ray_helpers import no_node_leaks
from tests.test_pool_rollout import ScalarInfoEnv, assert_rollout, assert_tree, reference
from tests.test_rollout_faults import (
    MARK_AT,
    SLOW,
    STEPS,
    Shift,
    assert_restarted_part,
    await_marker,
    start_then_kill,
)
from tests.test_weights_memory import MIB, Big, segments_mapped

__all__ = ["no_node_leaks"]  # fixtures, used by name

NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 << 20}
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}
N = 6


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[str]]:
    """The two worker nodes of the module's cluster (the head runs the pool: not used)."""
    assert not ray.is_initialized()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "include_dashboard": False, "_system_config": HEALTH_CHECKS},
    )
    try:
        added = [cluster.add_node(**NODE) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        yield [node.node_id for node in added]
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def agent_pids(pool: envfleet.Pool) -> list[int]:
    return [int(node.pid) for node in pool._transport._nodes]  # type: ignore[attr-defined]


def workers_of(agent: int) -> list[int]:
    """The worker processes of an agent: its fork server's children."""
    return [g.pid for c in psutil.Process(agent).children() for g in c.children()]


def read_chars(pids: list[int]) -> np.ndarray:
    return np.array([psutil.Process(pid).io_counters().read_chars for pid in pids])


def segments_held_by(pid: int) -> int:
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:envfleet-weights")
        except OSError:
            pass
    return held


def test_each_version_goes_once_to_each_node_into_one_segment_its_workers_map(
    nodes: list[str],
) -> None:
    """Two nodes of four workers, 10 MB of weights: per version, each node's message carries
    them once; its agent writes them once; its workers map that one segment, each reading a
    few hundred bytes from its pipe. The rollouts are the serial backend's."""
    versions = [0.5, -0.5]

    def run(**kwargs: Any) -> list[envfleet.Rollout]:
        policy = Big(versions[0])
        out = []
        with envfleet.make("CartPole-v1", 8, seed=0, **kwargs) as pool:
            pool.reset()
            if kwargs.get("backend") != "ray":
                return [pool.rollout(Big(v), 3) for v in versions]
            agents = agent_pids(pool)
            workers = [workers_of(agent) for agent in agents]
            assert [len(w) for w in workers] == [4, 4]
            for fill in versions:
                policy.w = np.full((4, 2), fill)
                sent = [n.bytes_out for n in pool.stats().nodes]
                read = [read_chars(w) for w in workers]
                out.append(pool.rollout(policy, 3))
                sent = [n.bytes_out - s for n, s in zip(pool.stats().nodes, sent, strict=True)]
                read = [read_chars(w) - r for w, r in zip(workers, read, strict=True)]
                carried = 2 if fill == versions[0] else 1  # the code holds them too, once
                assert all(carried * 10 * MIB < s < (carried + 0.1) * 10 * MIB for s in sent)
                # The first version's code imports its module in each worker (files read).
                assert all((r < (10 * MIB if carried == 2 else 4096)).all() for r in read), read
                mapped = [{frozenset(segments_mapped(pid)) for pid in w} for w in workers]
                assert all(len(m) == 1 and len(next(iter(m))) == 1 for m in mapped), mapped
                assert mapped[0] != mapped[1]  # one segment per node, its own
                assert [segments_held_by(agent) for agent in agents] == [1, 1]
        return out

    want = run(backend="serial")
    got = run(backend="ray", num_workers=8, nodes=nodes)
    for w, g in zip(want, got, strict=True):
        assert g.env_ids.tolist() == list(range(8))  # in the envs' order, however they came
        np.testing.assert_array_equal(w.actions, g.actions)
        np.testing.assert_array_equal(w.observations, g.observations)
    for version, g in enumerate(got, 1):
        assert (g.policy_versions == version).all()


def test_a_nodes_workers_record_a_large_part_where_their_agent_sends_it_from(
    nodes: list[str],
) -> None:
    """A rollout of over 1 MB a worker (CartPole x 8 on two nodes of two workers, 16,000
    steps): each worker records its part in its agent's shared memory, writing a few KB of it
    to its pipe rather than the part, and the rollout is the serial backend's, twice (the
    agent's blocks used again)."""
    steps = 16_000

    def written(pids: list[int]) -> np.ndarray:
        return np.array([psutil.Process(pid).io_counters().write_chars for pid in pids])

    with envfleet.make("CartPole-v1", 8, backend="serial", seed=0) as serial:
        serial.reset()
        want = [serial.rollout(envfleet.RandomPolicy(serial.single_action_space, 5), steps)]
        want.append(serial.rollout(envfleet.RandomPolicy(serial.single_action_space, 6), steps))
    with envfleet.make("CartPole-v1", 8, backend="ray", num_workers=4, nodes=nodes, seed=0) as pool:
        pool.reset()
        workers = [pid for agent in agent_pids(pool) for pid in workers_of(agent)]
        for k, w in enumerate(want):
            before = written(workers)
            got = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 5 + k), steps)
            fields = ("observations", "actions", "rewards", "terminations", "truncations")
            part = sum(getattr(got, name).nbytes for name in fields) // 4  # a worker's
            assert part > 1 << 20
            assert ((written(workers) - before) < part // 50).all(), written(workers) - before
            for name in fields:
                ours, theirs = getattr(got, name), getattr(w, name)
                assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), name


def mark_each(directory: str, counts: frozenset[int], env: FaultyEnv, action: Any) -> None:
    """A step hook: the env whose counter reaches one of ``counts`` writes its process id to
    ``directory/<count>`` (counters start at ``seed * 100``: one env reaches each)."""
    if env.count + 1 in counts:
        (Path(directory) / str(env.count + 1)).write_text(str(os.getpid()))


def node_pool(directory: Path, counts: set[int], nodes: list[str], on_error: str) -> envfleet.Pool:
    """Six slow counter envs over two nodes of two workers: node 0 runs workers 0 (envs 0-1)
    and 1 (envs 2-3), node 1 workers 2 (env 4) and 3 (env 5)."""
    hook = functools.partial(mark_each, str(directory), frozenset(counts))
    envs = [
        functools.partial(FaultyEnv, step_hook=hook, sleep=SLOW, episode_length=10**9)
        for _ in range(N)
    ]
    pool = envfleet.make(envs, backend="ray", num_workers=4, nodes=nodes, seed=0, on_error=on_error)
    assert [tuple(ids) for ids in pool._ledger.assignment] == [(0, 1), (2, 3), (4,), (5,)]
    return pool


def at(env: int, steps_before: int) -> int:
    """The count env ``env`` (reset with ``SEED + env``) reaches at the :data:`MARK_AT`-th step
    of a rollout after ``steps_before`` steps."""
    return (SEED + env) * 100 + steps_before + MARK_AT


def test_a_worker_then_a_node_lost_mid_rollout_restart_their_parts(
    nodes: list[str], tmp_path: Path
) -> None:
    """``on_error="restart"``. Rollout 2: worker 1 (envs 2 and 3, node 0) SIGKILLed; its agent
    replaces it and its part runs again. Rollout 3: node 1's agent SIGKILLed; a new agent runs
    its parts again, and the old one's workers end (nothing maps its segment any more). Each
    part whole, chosen by its version, every env-step counted once. Then ``close()`` with a
    rollout of 20 s out is bounded, and leaves nothing behind."""
    marks = {"worker": at(2, 2), "node": at(4, 2 + STEPS), "close": at(0, 2 + 2 * STEPS)}
    within = timing.bound(10.0, pools=4)
    pool = node_pool(tmp_path, set(marks.values()), nodes, "restart")
    try:
        agents, policy = agent_pids(pool), Shift(1)
        start_then_kill(pool, policy, tmp_path / str(marks["worker"]), None)
        before, counts = pool.stats(), (SEED + np.arange(N)) * 100 + 2
        got = pool.rollout_wait()
        lost = np.isin(np.arange(N), [2, 3])
        assert_restarted_part(got, lost, counts)
        np.testing.assert_array_equal(pool.restarts, lost.astype(np.int64))
        assert pool.stats().steps - before.steps == N * STEPS
        assert agent_pids(pool) == agents  # the agent replaced its worker, not itself

        old = [psutil.Process(pid) for pid in workers_of(agents[1])]
        (segment,) = segments_mapped(old[0].pid)
        policy.shift = np.array([0])
        assert pool.rollout_async(policy, STEPS) == 3
        await_marker(tmp_path / str(marks["node"]), within)
        os.kill(agents[1], signal.SIGKILL)
        before, counts = pool.stats(), got.final_observations[:, 0]
        got = pool.rollout_wait()
        lost = np.isin(np.arange(N), [4, 5])
        # The new agent's envs start from their rows as the pool holds them: where the rollout
        # began (a node's rows come back with its part only), not zeros; those stand.
        assert_restarted_part(got, lost, counts, version=3, shift=0, stood=range(1))
        np.testing.assert_array_equal(pool.restarts, [0, 0, 1, 1, 1, 1])
        assert pool.stats().steps - before.steps == N * STEPS
        assert agent_pids(pool)[1] != agents[1]
        _, alive = psutil.wait_procs(old, timeout=within)
        assert not alive
        mapping = [
            p.pid for p in psutil.Process().children(recursive=True) if segment in _mapped(p.pid)
        ]
        assert not mapping, mapping  # the cluster's processes (agents, workers) are ours

        pool.rollout_async(policy, 1000)  # 20 s a worker
        await_marker(tmp_path / str(marks["close"]), within)
        started = time.monotonic()
        pool.close(timeout=1.0)
        assert time.monotonic() - started < timing.bound(8.0, pools=3)
        with pytest.raises(envfleet.ClosedPoolError):
            pool.rollout_wait()
    finally:
        pool.close()


@pytest.mark.parametrize("lost", ["worker", "node"])
def test_a_worker_or_a_node_lost_mid_rollout_raises_naming_it(
    nodes: list[str], lost: str, tmp_path: Path
) -> None:
    """``on_error="raise"``: worker 1 (envs 2 and 3, node 0) SIGKILLed, or node 1's agent
    (workers 2 and 3): ``WorkerDiedError`` naming the worker and its envs, or the node; the
    pool is broken, and closes."""
    mark = at(2, 2) if lost == "worker" else at(4, 2)
    with node_pool(tmp_path, {mark}, nodes, "raise") as pool:
        agent = None if lost == "worker" else agent_pids(pool)[1]
        node = pool._transport._nodes[1]  # type: ignore[attr-defined]
        start_then_kill(pool, Shift(1), tmp_path / str(mark), agent)
        with pytest.raises(envfleet.WorkerDiedError) as caught:
            pool.rollout_wait()
        error = caught.value
        assert error.phase is envfleet.Phase.STEP
        if lost == "worker":
            assert (error.worker, error.env_ids) == (1, (2, 3))
        else:
            assert error.worker in (2, 3) and node.node_id in str(error)
        with pytest.raises(envfleet.BrokenPoolError):
            pool.rollout_wait()


def _mapped(pid: int) -> set[int]:
    """The weights segments ``pid`` maps (none once it has ended)."""
    try:
        return segments_mapped(pid)
    except OSError:
        return set()


def test_a_rollouts_scalar_infos_on_nodes_are_sync_vector_envs(nodes: list[str]) -> None:
    """Infos of plain scalars every env has travel from the nodes' workers as arrays, through
    their agents, and are stacked by the pool: SyncVectorEnv's, key for key, type for type."""
    fns = [functools.partial(ScalarInfoEnv, i) for i in range(4)]
    ref = SyncVectorEnv(fns)
    want, last = reference(ref, envfleet.RandomPolicy(ref.single_action_space, 0), "p" * 8)
    ref.close()
    with envfleet.make(fns, backend="ray", nodes=nodes, num_workers=2) as pool:
        pool.reset(seed=SEED)
        got = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 8)
    assert_rollout(got, want, "rollout on 2 nodes")
    assert_tree(got.final_observations, last, "final observations")


def test_queued_parts_on_nodes_are_the_rollouts_one_after_another(nodes: list[str]) -> None:
    """A part queued behind each worker's (``queue=True``) on 2 nodes x 2 workers: each
    hand-over is the serial backend's rollout of that turn, its final observations its own,
    each env once."""
    from tests.test_rollout_async import Linear, weights

    def rollouts(queue: bool, **kwargs: Any) -> list[envfleet.Rollout]:
        with envfleet.make("CartPole-v1", 8, seed=0, **kwargs) as pool:
            pool.reset()
            if not queue:
                return [pool.rollout(Linear(weights(v)), 7) for v in (1, 2, 3)]
            pool.rollout_async(Linear(weights(1)), 7)
            pool.rollout_async(Linear(weights(2)), 7, queue=True)
            got = [pool.rollout_wait()]
            pool.rollout_async(Linear(weights(3)), 7, queue=True)
            return [*got, pool.rollout_wait(), pool.rollout_wait()]

    want = rollouts(False, backend="serial")
    got = rollouts(True, backend="ray", num_workers=4, nodes=nodes)
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.env_ids.tolist() == list(range(8)) and (g.policy_versions == k + 1).all()
        for field in ("observations", "actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(w, field), getattr(g, field), f"{k} {field}")
        np.testing.assert_array_equal(w.final_observations, g.final_observations)
