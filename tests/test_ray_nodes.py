"""One sub-pool per node (``make(backend="ray")`` on a cluster) on a fake multi-node cluster.

A head and two worker nodes of ``ray.cluster_utils.Cluster``, all on this machine, shared by the
module (a cluster takes seconds to start). Each node's envs run in a local process pool behind
one agent; the pool exchanges one message per node per command. Trajectories are those of
``SyncVectorEnv`` whatever the number of nodes; a killed or stopped agent becomes a named error
(or a restart); nothing is left behind; the agent's socket refuses a wrong key.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
import ray
from gymnasium.envs.classic_control import CartPoleEnv
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from ray.cluster_utils import Cluster

import envfleet
import envfleet.infos
import envfleet.results
from envfleet.backends.nodes import agent as node_agent
from envfleet.backends.nodes import wire as node_wire
from envfleet.backends.nodes.actors import connect_agent
from envfleet.backends.nodes.agent import NodeAgent
from envfleet.backends.nodes.link import NodeLink
from envfleet.backends.nodes.options import node_options
from envfleet.backends.nodes.placement import place
from envfleet.backends.nodes.transport import NodeTransport
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.transport import RayTransport
from envfleet.info_columns import column_dicts, info_columns
from tests import timing
from tests.envs import ModulesCartPole
from tests.ray_helpers import no_node_leaks
from tests.test_equivalence import NUM_ENVS as EQUIVALENCE_ENVS
from tests.test_equivalence import SEED, Case, assert_same_run, drive
from tests.test_info_columns import INFO_SHIFT, InfoShiftEnv, assert_async_infos
from tests.test_infos import assert_same as assert_same_infos
from tests.test_infos import gymnasium_infos
from tests.test_pool_rollout import (
    POLICY_SEED,
    assert_rollout,
    assert_step_then_rollout,
    dict_envs,
    reference,
)
from tests.test_pool_rollout import SEED as SEED_OF_REFERENCE

__all__ = ["no_node_leaks"]  # fixtures, used by name

NUM_ENVS = 6
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    assert not ray.is_initialized()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "include_dashboard": False, "_system_config": HEALTH_CHECKS},
    )
    try:
        for _ in range(2):
            cluster.add_node(**NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def all_nodes(cluster: Cluster) -> list[str]:
    return [cluster.head_node.node_id, *(n.node_id for n in cluster.worker_nodes)]


class SlowCartPole(gymnasium.Wrapper[Any, Any, Any, Any]):
    """CartPole whose steps take ``delay`` seconds (so that a kill lands mid-step)."""

    def __init__(self, delay: float) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.delay = delay

    def step(self, action: Any) -> Any:
        time.sleep(self.delay)
        return self.env.step(action)


def trajectory(env: Any, steps: int, seed: int = 0) -> list[Any]:
    """Reset with ``seed`` then ``steps`` steps of fixed random actions: every field."""
    actions = np.random.default_rng(1).integers(0, 2, size=(steps, NUM_ENVS))
    out = [env.reset(seed=seed)[0]]
    for a in actions:
        out.extend(env.step(a)[:4])
    return out


def assert_same(want: list[Any], got: list[Any]) -> None:
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_array_equal(x, y, err_msg=f"item {k}")
        assert np.asarray(x).dtype == np.asarray(y).dtype, f"item {k}: dtype"


def test_place_lays_contiguous_runs_by_cpus() -> None:
    assert place([("a", 1), ("b", 1), ("c", 2)], 7) == [[0, 1], [2, 3], [4, 5, 6]]
    assert place([("a", 4), ("b", 1)], 2) == [[0], [1]]
    assert place([("a", 1), ("b", 2), ("c", 1)], 2) == [[0], [1], []]


@pytest.mark.parametrize(
    ("mode", "nodes"),
    [
        (AutoresetMode.NEXT_STEP, 1),
        (AutoresetMode.NEXT_STEP, 3),
        (AutoresetMode.SAME_STEP, 3),
        (AutoresetMode.DISABLED, 3),
    ],
)
def test_same_trajectories_as_sync_vector_env(
    cluster: Cluster, mode: AutoresetMode, nodes: int
) -> None:
    """Envs of different episode lengths (heterogeneous factories, so episodes end at
    different steps), one node or three: SyncVectorEnv's values and dtypes, bit for bit.

    On three nodes in NEXT_STEP mode, the same pool then answers call, get_attr and set_attr
    as SyncVectorEnv does (:func:`check_call_get_attr_set_attr_across_nodes`): a pool of three
    nodes takes seconds to start, so the two checks share it."""
    fns = heterogeneous()
    steps = 40
    reference = SyncVectorEnv(fns, autoreset_mode=mode)
    if mode is AutoresetMode.DISABLED:
        want = _disabled_run(reference, steps)
    else:
        want = trajectory(reference, steps)
    reference.close()
    with envfleet.make(
        fns,
        backend="ray",
        num_workers=3,
        nodes=all_nodes(cluster)[:nodes],
        autoreset_mode=mode,
    ) as pool:
        assert len({node for node in pool._transport.node_ids()}) == nodes
        got = (
            _disabled_run(pool, steps)
            if mode is AutoresetMode.DISABLED
            else trajectory(pool, steps)
        )
        assert_same(want, got)
        if mode is AutoresetMode.NEXT_STEP and nodes == 3:
            check_call_get_attr_set_attr_across_nodes(pool, fns)


def heterogeneous(n: int = NUM_ENVS) -> list[Any]:
    """CartPoles whose episodes end at different steps."""
    return [
        functools.partial(gymnasium.make, "CartPole-v1", max_episode_steps=8 + 3 * i)
        for i in range(n)
    ]


def test_default_on_a_cluster_is_one_sub_pool_per_node_one_message_each(cluster: Cluster) -> None:
    """No ``nodes=``: on a cluster of three nodes the pool runs a sub-pool on each, with
    SyncVectorEnv's trajectories, and a reset, a call, get_attr and set_attr are one message
    per node each, as a step is (two workers per node)."""
    reference = SyncVectorEnv(heterogeneous())
    want = trajectory(reference, 20)
    with envfleet.make(heterogeneous(), backend="ray", num_workers=6) as pool:
        transport = pool._transport
        assert isinstance(transport, NodeTransport)
        nodes = pool.stats().nodes
        assert sorted(n.node for n in nodes) == sorted(all_nodes(cluster))
        assert [n.workers for n in nodes] == [2, 2, 2]
        # The pool's own node (the head): its workers are actors on the pool's memory. The
        # nodes come in the order of their rows, which is Ray's order of its nodes.
        assert [n.node for n in nodes if n.shared_memory] == [cluster.head_node.node_id]

        def messages() -> list[tuple[bool, int]]:  # the pool's own node last
            return sorted((n.shared_memory, n.messages) for n in pool.stats().nodes)

        here = transport._here
        assert here is not None and here.transport.same_machine() == [True, True]
        got = trajectory(pool, 20)
        # A reset and 20 steps: one message per node each, one per worker on the pool's node.
        assert messages() == [(False, 21), (False, 21), (True, 42)]
        assert pool.call("get_wrapper_attr", "np_random_seed") == reference.call(
            "get_wrapper_attr", "np_random_seed"
        )
        pool.set_attr("marker", list(range(NUM_ENVS)))
        assert pool.get_attr("marker") == tuple(range(NUM_ENVS))
        assert messages() == [(False, 24), (False, 24), (True, 48)]
        pool.reset(seed=1, options={"reset_mask": np.arange(NUM_ENVS) % 2 == 0})
        assert messages() == [(False, 25), (False, 25), (True, 49)]
    reference.close()
    assert_same(want, got)


def check_a_lost_worker_on_the_pools_own_node_restarts_alone(pool: envfleet.Pool) -> None:
    """A worker on the pool's node (an actor on its memory) is killed: only its envs restart,
    the agents of the other nodes go on untouched, and the run goes on (``pool`` made with
    ``on_error="restart"``; run by :func:`test_repr_stats_and_one_message_per_node`)."""
    transport = pool._transport
    assert isinstance(transport, NodeTransport) and transport._here is not None
    (worker,) = transport._here.workers
    lost = np.isin(np.arange(NUM_ENVS), pool._ledger.assignment[worker])
    pids = [node.pid for node in transport._nodes]
    actions = np.ones(NUM_ENVS, dtype=np.int64)
    pool.reset()
    pool.step(actions)
    pid = transport._here.transport._workers[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    restarted = np.zeros(NUM_ENVS, dtype=bool)
    for _ in range(20):
        _, rewards, _, truncations, infos = pool.step(actions)
        if "envfleet/restarted" in infos:
            now = infos["_envfleet/restarted"]
            assert truncations[now].all() and (rewards[now] == 0).all()
            restarted |= now
        if restarted.any():
            break
    assert (restarted == lost).all(), f"lost worker: restarted {restarted}, expected {lost}"
    assert [node.pid for node in transport._nodes] == pids, "lost worker: an agent was replaced"
    assert transport._here.transport.same_machine() == [True]
    for _ in range(3):
        pool.step(actions)


FORKING_DRIVER = """
import gc, os, sys, time
import numpy as np, ray, envfleet
ray.init(address=sys.argv[1], log_to_driver=False)
pool = envfleet.make(
    "CartPole-v1", 6, backend="ray", num_workers=3, nodes=sys.argv[2].split(","), seed=0
)
pool.reset(seed=0)
pid = os.fork()
if pid == 0:
    pool.close()
    del pool
    gc.collect()
    sys.exit(3)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("child hung", flush=True)
print(*pool.step(np.ones(6, dtype=np.int64))[0].ravel().tolist(), flush=True)
pool.close()
print("parent done", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["with the pool's node", "other nodes"])
def test_a_forked_child_exits_and_leaves_its_parents_node_pool_alone(
    cluster: Cluster, where: str
) -> None:
    """A driver (another process, joined to the cluster) forks while its pool of node sub-pools
    is open; the child closes the pool and exits (``sys.exit(3)``): it ends at once with its
    status, sending nothing to the agents (nor to the actors of the pool's own node) and
    leaving the parent's Ray connection alone, and the parent's pool steps on as before."""
    nodes = all_nodes(cluster) if where == "with the pool's node" else all_nodes(cluster)[1:]
    result = subprocess.run(
        [sys.executable, "-c", FORKING_DRIVER, cluster.address, ",".join(nodes)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = result.stdout.split("\n")
    assert lines[0] == "child 3" and lines[2] == "parent done", result.stdout + result.stderr
    oracle = SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * NUM_ENVS)
    oracle.reset(seed=0)
    want = oracle.step(np.ones(NUM_ENVS, dtype=np.int64))[0]
    np.testing.assert_array_equal(np.array(lines[1].split(), np.float32), want.ravel())
    assert "SIGSEGV" not in result.stderr and "Fatal Python error" not in result.stderr


def test_nodes_false_keeps_one_actor_per_worker(cluster: Cluster) -> None:
    reference = SyncVectorEnv(heterogeneous())
    want = trajectory(reference, 6)
    reference.close()
    with envfleet.make(heterogeneous(), backend="ray", num_workers=3, nodes=False) as pool:
        assert isinstance(pool._transport, RayTransport)
        assert pool.stats().nodes == ()
        got = trajectory(pool, 6)
    assert_same(want, got)


def test_a_nodes_workers_import_no_ray(cluster: Cluster) -> None:
    """An agent's workers run envfleet's worker loop and nothing of Ray: neither the agent's
    main module (Ray's worker script, which multiprocessing would have each of them import
    first) nor the node's options they unpickle bring Ray in (~0.4 s of CPU and ~40 MB a
    worker here)."""
    others = [node.node_id for node in cluster.worker_nodes]
    with envfleet.make(ModulesCartPole, 4, backend="ray", nodes=others, num_workers=2) as pool:
        assert sorted(node.node for node in pool.stats().nodes) == sorted(others)
        assert pool.call("imported", "envfleet.worker") == (True,) * 4
        assert pool.call("imported", "ray") == (False,) * 4


def test_nodes_option_is_checked() -> None:
    assert RayOptions(nodes=False).nodes is False
    assert RayOptions(nodes=["a", "b"]).nodes == ("a", "b")
    for bad in (True, "all", [], [1]):
        with pytest.raises(ValueError, match="nodes must be"):
            RayOptions(nodes=bad)  # type: ignore[arg-type]


def _disabled_run(env: Any, steps: int) -> list[Any]:
    """DISABLED mode: reset the envs that ended (reset_mask) after each step."""
    actions = np.random.default_rng(1).integers(0, 2, size=(steps, NUM_ENVS))
    out = [env.reset(seed=0)[0]]
    for a in actions:
        obs, rewards, terminations, truncations, _ = env.step(a)
        out += [obs, rewards, terminations, truncations]
        done = terminations | truncations
        if done.any():
            out.append(env.reset(options={"reset_mask": done})[0])
    return out


@pytest.mark.parametrize(
    ("where", "workers", "batch"),
    [("all", 3, 2), ("others", 4, NUM_ENVS // 2), ("process", 4, NUM_ENVS // 2)],
)
def test_async_batches_match_each_envs_own_trajectory(
    cluster: Cluster, where: str, workers: int, batch: int
) -> None:
    """batch_size < num_envs over three nodes, or in halves over two nodes of two workers each
    (each node keeps two halves in flight, answered apart), and on the process backend: whichever
    envs come back, each env's sequence is that of the same env stepped alone (seed + i, actions
    by its own step count)."""
    steps = 12
    rng = np.random.default_rng(3)
    plan = rng.integers(0, 2, size=(NUM_ENVS, steps + 1))
    want = []
    for i in range(NUM_ENVS):
        env = SyncVectorEnv(
            [lambda: gymnasium.make("CartPole-v1")], autoreset_mode=AutoresetMode.SAME_STEP
        )
        seq = [env.reset(seed=i)[0][0]]
        for t in range(steps):
            obs, *_ = env.step(np.array([plan[i, t]]))
            seq.append(obs[0])
        want.append(seq)
    got: list[list[Any]] = [[] for _ in range(NUM_ENVS)]
    layout: dict[str, Any] = {"backend": "process"}
    if where != "process":
        nodes = all_nodes(cluster) if where == "all" else all_nodes(cluster)[1:]
        layout = {"backend": "ray", "nodes": nodes}
    with envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        num_workers=workers,
        batch_size=batch,
        seed=0,
        autoreset_mode="SameStep",
        **layout,
    ) as pool:
        pool.async_reset()
        while min(len(s) for s in got) <= steps:
            obs, _, _, _, infos = pool.recv()
            ids = infos["env_id"]
            for row, i in zip(obs, ids, strict=True):
                got[i].append(row.copy())
            actions = np.array([plan[i, min(len(got[i]) - 1, steps)] for i in ids])
            pool.send(actions, ids)
        pool.recv()
        if where == "others":  # two workers a node: a half each
            assert [n.workers for n in pool.stats().nodes] == [2, 2]
    for i in range(NUM_ENVS):
        np.testing.assert_array_equal(np.array(want[i]), np.array(got[i][: steps + 1]))


def test_repr_stats_and_one_message_per_node(cluster: Cluster) -> None:
    """The layout and each node's traffic in stats() and repr(); then, on the same pool (its
    start takes seconds), a worker of the pool's own node is lost and restarts alone
    (:func:`check_a_lost_worker_on_the_pools_own_node_restarts_alone`)."""
    with envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        backend="ray",
        num_workers=3,
        nodes="auto",
        seed=0,
        on_error="restart",
    ) as pool:
        transport = pool._transport
        assert isinstance(transport, NodeTransport)
        layout = [(n.node_id, n.host, len(n.workers)) for n in transport._nodes]
        assert sorted(n[0] for n in layout) == sorted(n.node_id for n in cluster.worker_nodes)
        pool.reset()

        # The pool's own node first, then the agents' in their order (the rows' order is
        # Ray's order of its nodes: test_stats_and_repr_place_each_env_on_its_node_in_row_order).
        def own_first() -> list[Any]:
            return sorted(pool.stats().nodes, key=lambda n: not n.shared_memory)

        before = [n.messages for n in own_first()]
        for _ in range(10):
            pool.step(np.ones(NUM_ENVS, dtype=np.int64))
        after = [n.messages for n in own_first()]
        assert "envs/" in repr(transport)
        # The layout and each node's traffic reach the pool's own stats() and repr().
        here, *nodes = own_first()
        # The pool's own node: one actor per worker on the pool's memory, no agent, no copy.
        assert here.node == cluster.head_node.node_id and here.shared_memory
        assert here.bytes_in == here.bytes_out == 0 and here.round_trip_ms is None
        assert after[0] - before[0] == 10 * here.workers  # one per worker per step
        assert [b - a for a, b in zip(before[1:], after[1:], strict=True)] == [10] * len(layout)
        assert [(n.node, n.address, n.workers) for n in nodes] == layout
        assert here.workers + sum(n.workers for n in nodes) == 3
        assert here.envs + sum(n.envs for n in nodes) == NUM_ENVS
        row = 4 * 4 + 8 + 1 + 1  # a CartPole observation, reward, both flags
        for node in nodes:
            assert not node.shared_memory
            assert node.messages >= 11 and node.answers >= 11  # the reset and ten steps
            assert node.bytes_in >= 10 * node.envs * row and node.bytes_out > 0
            assert node.round_trip_ms is not None and node.round_trip_ms > 0
        for node in (here, *nodes):
            assert f"{node.node[:8]} {node.envs} envs/{node.workers} workers" in repr(pool)
        assert pool.stats().as_dict()["nodes"][0]["envs"] == pool.stats().nodes[0].envs  # JSON
        check_a_lost_worker_on_the_pools_own_node_restarts_alone(pool)
    assert "nodes=" not in repr(pool)  # closed: no layout to ask for


class PidCartPole(CartPoleEnv):
    """CartPole that knows the process it was built in (``pid``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()


def test_stats_and_repr_place_each_env_on_its_node_in_row_order(cluster: Cluster) -> None:
    """The pool's own node holds the last rows (``nodes=`` lists it last): ``stats().nodes``
    and ``repr(pool)`` list the nodes in the order of their rows, each node names its workers
    and envs, each worker its node, and each env does run there (its process is one of that
    node's: an actor of the pool's own node, or a worker process under that node's agent)."""
    head, *others = all_nodes(cluster)
    with envfleet.make(
        PidCartPole, NUM_ENVS, backend="ray", num_workers=3, nodes=[*others, head], seed=0
    ) as pool:
        transport = pool._transport
        assert isinstance(transport, NodeTransport)
        stats = pool.stats()
        nodes = stats.nodes
        assert [n.node for n in nodes] == [*others, head]
        assert [n.shared_memory for n in nodes] == [False, False, True]
        assert [n.env_ids for n in nodes] == [(0, 1), (2, 3), (4, 5)]
        assert [n.worker_ids for n in nodes] == [(0,), (1,), (2,)]
        assert all(n.envs == len(n.env_ids) and n.workers == len(n.worker_ids) for n in nodes)
        listed = {w: n.node for n in nodes for w in n.worker_ids}
        assert [w.node for w in stats.workers] == [listed[w.worker] for w in stats.workers]
        assert [w.node for w in stats.workers] == transport.node_ids()
        assert stats.as_dict()["workers"][2]["node"] == head  # plain, for JSON
        text = repr(pool)
        at = [text.index(f"{n.node[:8]} {n.envs} envs/{n.workers} workers") for n in nodes]
        assert at == sorted(at), text
        assert f"{head[:8]} 2 envs/1 workers (envs 4-5)" in text
        assert [repr(transport).index(n.node[:8]) for n in nodes] == sorted(
            repr(transport).index(n.node[:8]) for n in nodes
        )
        pids = pool.get_attr("pid")
        assert transport._here is not None
        actors = {slot.pid for slot in transport._here.transport._workers}
        agents = {link.node_id: link.pid for link in transport._nodes}
        for node in nodes:
            for i in node.env_ids:
                if node.shared_memory:
                    assert pids[i] in actors, (i, node.node)
                else:
                    parents = {p.pid for p in psutil.Process(pids[i]).parents()}
                    assert agents[node.node] in parents, (i, node.node)


def test_pools_without_node_sub_pools_report_no_nodes() -> None:
    with envfleet.make("CartPole-v1", 2, backend="process", num_workers=2) as pool:
        pool.reset(seed=0)
        assert pool.stats().nodes == ()
        assert "nodes=" not in repr(pool)


def test_one_answer_per_node_per_step_when_workers_finish_apart(cluster: Cluster) -> None:
    """Steps long enough that a node's workers reply milliseconds apart: still one message each
    way per node per step (the agent holds a whole round's answer until it is complete)."""
    with envfleet.make(
        functools.partial(SlowCartPole, 0.02),
        NUM_ENVS,
        backend="ray",
        num_workers=4,
        nodes=all_nodes(cluster)[1:],
        seed=0,
    ) as pool:
        pool.reset()
        before = pool.stats().nodes
        for _ in range(5):
            pool.step(np.ones(NUM_ENVS, dtype=np.int64))
        after = pool.stats().nodes
        assert [b.messages - a.messages for a, b in zip(before, after, strict=True)] == [5, 5]
        assert [b.answers - a.answers for a, b in zip(before, after, strict=True)] == [5, 5]


def agent_pid(pool: envfleet.Pool, node: int) -> int:
    return int(pool._transport._nodes[node].pid)


SLOW_STEP = 0.1
"""Seconds a step of :func:`make_slow`'s envs takes: a kill right after ``send`` lands while the
node's workers step (two envs each, so 0.2 s a round)."""


def make_slow(cluster: Cluster, **kwargs: Any) -> envfleet.Pool:
    return envfleet.make(
        functools.partial(SlowCartPole, SLOW_STEP),
        NUM_ENVS,
        backend="ray",
        num_workers=3,
        nodes=all_nodes(cluster)[1:],
        seed=0,
        **kwargs,
    )


def test_agent_killed_mid_step_raises_worker_died_naming_node(cluster: Cluster) -> None:
    with make_slow(cluster, on_error="raise") as pool:
        pool.reset()
        node = pool._transport._nodes[1]
        pool.send(np.ones(NUM_ENVS, dtype=np.int64))
        os.kill(agent_pid(pool, 1), signal.SIGKILL)
        with pytest.raises(envfleet.WorkerDiedError) as info:
            pool.recv()
        error = info.value
        assert error.phase is envfleet.Phase.STEP
        assert error.worker in node.workers
        assert node.node_id in str(error)
        held = [i for w in node.workers for i in pool._ledger.assignment[w]]
        assert str(held[0]) in str(error)
        with pytest.raises(envfleet.BrokenPoolError):
            pool.step(np.ones(NUM_ENVS, dtype=np.int64))


def test_agent_killed_mid_step_restarts_its_envs(cluster: Cluster) -> None:
    with make_slow(cluster, on_error="restart") as pool:
        pool.reset()
        node = pool._transport._nodes[0]
        lost = np.zeros(NUM_ENVS, dtype=bool)
        lost[[i for w in node.workers for i in pool._ledger.assignment[w]]] = True
        pool.send(np.ones(NUM_ENVS, dtype=np.int64))
        os.kill(agent_pid(pool, 0), signal.SIGKILL)
        _, rewards, _, truncations, infos = pool.recv()
        assert "envfleet/restarted" in infos
        now = infos["_envfleet/restarted"]
        assert (now == lost).all()
        assert truncations[now].all() and (rewards[now] == 0).all()
        assert (pool.restarts == lost).all()
        for _ in range(3):
            pool.step(np.ones(NUM_ENVS, dtype=np.int64))


def node_step_timeout() -> float:
    """``step_timeout`` for the tests that wait it out (a stopped agent, a hung worker): 1.5 s,
    or three times what a process pool's life costs now (a busy machine's steps and replies
    are slower; :mod:`tests.timing`), so that a step merely slow never times out."""
    return timing.bound(1.5, pools=3)


def test_stopped_agent_is_killed_past_step_timeout(cluster: Cluster) -> None:
    with make_slow(cluster, on_error="raise", step_timeout=node_step_timeout()) as pool:
        pool.reset()
        pid = agent_pid(pool, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(envfleet.EnvTimeoutError) as info:
                pool.step(np.ones(NUM_ENVS, dtype=np.int64))
            # Silent since the round: killed after SILENT_GRACE (1 s), not KILL_GRACE (2 s).
            assert time.monotonic() - start < node_step_timeout() + timing.bound(1.6, pools=1)
            assert info.value.worker in pool._transport._nodes[1].workers
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_agent_socket_refuses_a_wrong_key(cluster: Cluster) -> None:
    """A connection without the pool's key is dropped; the pool's own connects after it.

    Before it serves, the same agent (a start takes seconds) says how many cores its local pool
    counts on: its node's (1 here), not the machine's (see
    :func:`test_an_agent_counts_its_nodes_cores_not_the_machines`)."""
    options = _options(cluster)
    agent = ray.remote(NodeAgent).options(num_cpus=0).remote(options, {})
    try:
        error, _, host, port, _ = ray.get(agent.start.remote(b"k" * 32), timeout=120)
        assert error is None
        cores = ray.get(agent.__ray_call__.remote(lambda a: a.local._cores), timeout=60)
        assert cores == 1, f"the agent's local pool counts {cores} cores, not its node's 1"
        serving = agent.serve.remote()
        with pytest.raises(AuthenticationError):
            connect_agent(host, port, b"x" * 32)
        conn = connect_agent(host, port, b"k" * 32)
        conn.send_bytes(node_wire.CLOSE)
        assert conn.recv_bytes()[:1] == node_wire.ACK
        ray.get(serving, timeout=60)
        conn.close()
    finally:
        ray.kill(agent, no_restart=True)


def _options(cluster: Cluster) -> Any:
    """Node options for one worker of two CartPoles, built as make() builds them."""
    from envfleet.backends.contract.base import TransportOptions
    from envfleet.spec import EnvSpec

    env = gymnasium.make("CartPole-v1")
    options = TransportOptions(
        spec=EnvSpec.from_user("CartPole-v1", None),
        assignment=[(0, 1)],
        observation_space=env.observation_space,
        action_space=env.action_space,
        autoreset_mode=AutoresetMode.NEXT_STEP,
    )
    return node_options(options, [0])


@pytest.fixture
def spare_node(cluster: Cluster) -> Iterator[Any]:
    """A node of its own for a test to remove (added back as it was after)."""
    node = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    yield node
    if node in cluster.worker_nodes:
        cluster.remove_node(node)


def test_node_removed_mid_run_restarts_its_envs_elsewhere(
    cluster: Cluster, spare_node: Any
) -> None:
    """The node is killed without warning: its envs are rebuilt on a surviving node, flagged
    restarted, and the run goes on."""
    with envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        backend="ray",
        num_workers=2,
        nodes=[cluster.head_node.node_id, spare_node.node_id],
        seed=0,
        on_error="restart",
    ) as pool:
        pool.reset()
        actions = np.ones(NUM_ENVS, dtype=np.int64)
        pool.step(actions)
        lost = np.array(pool._transport.node_ids()) == spare_node.node_id
        lost_envs = np.zeros(NUM_ENVS, dtype=bool)
        lost_envs[[i for w in np.flatnonzero(lost) for i in pool._ledger.assignment[w]]] = True
        cluster.remove_node(spare_node, allow_graceful=False)
        restarted = np.zeros(NUM_ENVS, dtype=bool)
        start = time.monotonic()
        while not (restarted == lost_envs).all() and time.monotonic() - start < 60:
            _, _, _, truncations, infos = pool.step(actions)
            if "envfleet/restarted" in infos:
                now = infos["_envfleet/restarted"]
                assert truncations[now].all()
                restarted |= now
        assert (restarted == lost_envs).all(), f"restarted {restarted}, expected {lost_envs}"
        assert spare_node.node_id not in pool._transport.node_ids()
        for _ in range(3):
            pool.step(actions)


def check_call_get_attr_set_attr_across_nodes(pool: envfleet.Pool, fns: list[Any]) -> None:
    """Values per env come back in env order from every node, as from SyncVectorEnv (run by
    :func:`test_same_trajectories_as_sync_vector_env` on its pool of three nodes)."""
    assert len(pool.stats().nodes) == 3, "call/get_attr/set_attr: not on three nodes"
    reference = SyncVectorEnv(fns)
    try:
        want = [s.max_episode_steps for s in reference.get_attr("spec")]
        got = [s.max_episode_steps for s in pool.get_attr("spec")]
        assert got == want, f"get_attr('spec') across nodes: {got}, not {want}"
        pool.set_attr("marker", list(range(100, 100 + NUM_ENVS)))
        marker = list(pool.get_attr("marker"))
        assert marker == list(range(100, 100 + NUM_ENVS)), f"set_attr then get_attr: {marker}"
        pool.reset(seed=5)
        reference.reset(seed=5)
        assert pool.call("get_wrapper_attr", "np_random_seed") == reference.call(
            "get_wrapper_attr", "np_random_seed"
        ), "call('get_wrapper_attr', 'np_random_seed') after reset(seed=5)"
    finally:
        reference.close()


def broken_on_env_4(i: int) -> gymnasium.Env[Any, Any]:
    if i == 4:
        raise ValueError("env 4 cannot be built")
    return gymnasium.make("CartPole-v1")


def test_an_env_that_cannot_be_built_names_itself_and_leaves_nothing(cluster: Cluster) -> None:
    """The env's own error, naming env 4 and the pool's worker (not the agent's own index);
    the other nodes' agents and workers are stopped (the leak check)."""
    fns = [functools.partial(broken_on_env_4, i) for i in range(NUM_ENVS)]
    fns[0] = lambda: gymnasium.make("CartPole-v1")  # the probe builds env 0 in this process
    with pytest.raises(ValueError, match="env 4 cannot be built") as info:
        envfleet.make(fns, backend="ray", num_workers=3, nodes=all_nodes(cluster))
    error = info.value
    assert isinstance(error, envfleet.EnvError)
    assert error.env_index == 4 and error.worker == 2 and error.phase is envfleet.Phase.MAKE


def hang_once(i: int, marker: str) -> gymnasium.Env[Any, Any]:
    """CartPole; env 1 hangs in its 3rd step, once (the marker file says it did)."""
    env = gymnasium.make("CartPole-v1")
    if i != 1:
        return env

    class Hang(gymnasium.Wrapper[Any, Any, Any, Any]):
        steps = 0

        def step(self, action: Any) -> Any:
            self.steps += 1
            if self.steps == 3 and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(3600)
            return self.env.step(action)

    return Hang(env)


def test_a_hung_worker_is_killed_by_its_agent_and_only_its_envs_restart(
    cluster: Cluster, tmp_path: Any
) -> None:
    """step_timeout on one hung worker: its agent kills it and rebuilds it; the node's agent,
    and every other env, go on untouched. The timeout, 1 s, is under the agent's wait slice
    (``WAIT_SLICE``) plus its hold: an agent that held its fast workers' replies until the
    round was whole (or a slice passed) would get them judged hung beside the hung one. A
    healthy CartPole step's reply reaches the pool in milliseconds."""
    marker = str(tmp_path / "hung")
    fns = [functools.partial(hang_once, i, marker) for i in range(NUM_ENVS)]
    with envfleet.make(
        fns,
        backend="ray",
        num_workers=3,
        nodes=all_nodes(cluster)[1:],
        seed=0,
        on_error="restart",
        step_timeout=1.0,
    ) as pool:
        pool.reset()
        pids = [node.pid for node in pool._transport._nodes]
        actions = np.ones(NUM_ENVS, dtype=np.int64)
        restarted = np.zeros(NUM_ENVS, dtype=bool)
        for _ in range(5):
            _, _, _, truncations, infos = pool.step(actions)
            if "envfleet/restarted" in infos:
                now = infos["_envfleet/restarted"]
                assert truncations[now].all()
                restarted |= now
        assert os.path.exists(marker)
        assert restarted.tolist() == [i in pool._ledger.assignment[0] for i in range(NUM_ENVS)]
        assert pool.restarts.tolist() == restarted.astype(int).tolist()
        assert [node.pid for node in pool._transport._nodes] == pids, "an agent was replaced"


class Frames(gymnasium.Env[dict[str, Any], np.int64]):
    """Small frames (mostly black, a patch of seeded noise that moves) beside a float vector:
    an image field that compresses and one that does not. Episodes end at ``length`` steps."""

    def __init__(self, length: int, dtype: str = "uint8") -> None:
        self.dtype = np.dtype(dtype)  # float32: the frames as floats, / 128 - 1
        low, high = (0, 255) if self.dtype == np.uint8 else (-1, 1)
        self.observation_space = gymnasium.spaces.Dict(
            {
                "frame": gymnasium.spaces.Box(low, high, (24, 32, 3), self.dtype),
                "pos": gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32),
            }
        )
        self.action_space = gymnasium.spaces.Discrete(4)
        self.length = length
        self._t = 0

    def _obs(self, action: int) -> dict[str, Any]:
        frame = np.zeros((24, 32, 3), np.uint8)
        at = (self._t * 3 + action) % 20
        frame[at : at + 4, at : at + 6] = self.np_random.integers(0, 256, (4, 6, 3))
        pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        if self.dtype != np.uint8:
            return {"frame": (frame / 128 - 1).astype(self.dtype), "pos": pos}
        return {"frame": frame, "pos": pos}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self._t = 0
        return self._obs(0), {}

    def step(self, action: Any) -> Any:
        self._t += 1
        obs = self._obs(int(action))
        return obs, float(obs["pos"][0]), self._t >= self.length, False, {}


@pytest.mark.parametrize(
    ("compress", "dtype"),
    [(None, "uint8"), ("zlib", "uint8"), ("lz4", "uint8"), ("lz4", "float32")],
)
def test_compressed_frames_are_bit_identical(
    cluster: Cluster, compress: str | None, dtype: str
) -> None:
    """compress= changes the bytes on the wire, never the values: SyncVectorEnv's image and
    vector observations, bit for bit, on three nodes, frames of uint8 or of floats; the nodes
    send far fewer bytes. A rollout's frames travel compressed too (a block per step), and
    the rollout is the serial backend's, bit for bit."""
    fns = [functools.partial(Frames, 5 + i, dtype) for i in range(NUM_ENVS)]
    reference = SyncVectorEnv(fns)
    want = trajectory(reference, 20)
    reference.close()
    with envfleet.make(fns, backend="serial") as serial:
        serial.reset(seed=3)
        want_rollout = serial.rollout(envfleet.RandomPolicy(serial.single_action_space, 0), 12)
    with envfleet.make(
        fns, backend="ray", num_workers=3, nodes=all_nodes(cluster), compress=compress
    ) as pool:
        got = trajectory(pool, 20)
        nodes = pool.stats().nodes
        received = sum(n.bytes_in for n in nodes)
        sent = sum(n.envs for n in nodes if not n.shared_memory)  # the pool's own: no copy
        pool.reset(seed=3)
        before = sum(n.bytes_in for n in pool.stats().nodes)
        rollout = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 12)
        rollout_bytes = sum(n.bytes_in for n in pool.stats().nodes) - before
    for name in ("actions", "rewards", "terminations", "truncations"):
        np.testing.assert_array_equal(getattr(rollout, name), getattr(want_rollout, name))
    for key in ("frame", "pos"):
        np.testing.assert_array_equal(rollout.observations[key], want_rollout.observations[key])
        assert rollout.observations[key].dtype == want_rollout.observations[key].dtype
    rollout_frames = 12 * sent * 24 * 32 * 3 * np.dtype(dtype).itemsize
    assert (rollout_bytes < rollout_frames / 4) is (compress is not None), rollout_bytes
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        if isinstance(x, dict):
            for key in x:
                np.testing.assert_array_equal(x[key], y[key], err_msg=f"item {k} {key}")
                assert x[key].dtype == y[key].dtype
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"item {k}")
    frames = 21 * sent * 24 * 32 * 3 * np.dtype(dtype).itemsize  # the reset and 20 steps
    assert sent == 4  # the two nodes besides the pool's own
    if compress is None:
        assert received > frames
    else:
        assert received < frames / 4, f"{received} bytes for {frames} bytes of frames"


def test_compress_is_refused_where_it_has_nothing_to_do(cluster: Cluster) -> None:
    """A bad name, a pool without node sub-pools and a space without images: a clear error
    before any agent or actor starts."""
    with pytest.raises(ValueError, match="compress must be one of 'lz4', 'zlib' or None"):
        envfleet.make("CartPole-v1", 2, backend="ray", nodes="auto", compress="gzip")
    with pytest.raises(ValueError, match="compress='zlib' compresses what node sub-pools send"):
        envfleet.make(functools.partial(Frames, 5), 2, backend="ray", nodes=False, compress="zlib")
    with pytest.raises(ValueError, match=r"compresses image observations.*has none"):
        envfleet.make("CartPole-v1", 2, backend="ray", nodes="auto", compress="lz4")
    with pytest.raises(ValueError, match="compress is an option of backend='ray'"):
        envfleet.make(functools.partial(Frames, 5), 2, backend="process", compress="lz4")


class Leaky(gymnasium.Wrapper[Any, Any, Any, Any]):
    """CartPole that keeps 10 MiB more (written, so resident) each step when ``leaks``."""

    def __init__(self, leaks: bool) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))
        self.leaks = leaks
        self.kept: list[np.ndarray] = []

    def step(self, action: Any) -> Any:
        if self.leaks:
            self.kept.append(np.ones(10 << 20, dtype=np.uint8))
        return self.env.step(action)


def test_worker_memory_limit_recycles_a_leaking_worker_on_its_node(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each agent reports its workers' memory; the worker of the leaking env (env 5, worker 2)
    is replaced by its agent between steps, its envs flagged restarted, nothing else touched."""
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    fns = [functools.partial(Leaky, i == 5) for i in range(NUM_ENVS)]
    with envfleet.make(
        fns,
        backend="ray",
        num_workers=3,
        nodes=all_nodes(cluster)[1:],
        seed=0,
        worker_memory_limit=1 << 40,
    ) as pool:
        pool.reset()
        actions = np.ones(NUM_ENVS, dtype=np.int64)
        memory = pool._transport.memory
        pids = [node.pid for node in pool._transport._nodes]
        for _ in range(20):  # the agents' first reports
            pool.step(actions)
            if all(memory(w) is not None for w in range(3)):
                break
        used = [memory(w) for w in range(3)]
        assert all(u is not None and u > 10 << 20 for u in used), used
        limit = max(u for u in used if u is not None) + (45 << 20)
        pool.worker_memory_limit = limit  # worker 2 grows over it after about 5 steps
        flagged = []
        for step in range(20):
            _, _, _, truncations, infos = pool.step(actions)
            if "envfleet/restarted" in infos:
                now = infos["_envfleet/restarted"]
                assert truncations[now].all()
                flagged.append((step, np.flatnonzero(now).tolist()))
            if flagged and step > flagged[0][0] + 3:
                break
        assert [envs for _, envs in flagged] == [[4, 5]], flagged
        assert [w.recycled for w in pool.stats().workers] == [0, 0, 1]
        assert pool.restarts.tolist() == [0] * NUM_ENVS  # a recycle is not a restart
        assert [node.pid for node in pool._transport._nodes] == pids, "an agent was replaced"
        now = memory(2)
        assert now is None or now < limit


DRIVER = """
import sys, time
import numpy as np, ray, envfleet
ray.init(address=sys.argv[1], log_to_driver=False)
pool = envfleet.make("CartPole-v1", 6, backend="ray", num_workers=3, nodes="auto", seed=0)
pool.reset()
print(*(node.pid for node in pool._transport._nodes), flush=True)
print(*(actor.pid for actor in pool._transport._here.transport._workers), flush=True)
while True:
    pool.step(np.ones(6, dtype=np.int64))
    time.sleep(0.01)
"""


def test_nothing_is_left_on_any_node_when_the_driver_is_killed(cluster: Cluster) -> None:
    """A driver (another process, joined to the cluster) steps a pool of three nodes and is
    killed (SIGKILL: no close()); every node's agent and every worker process of each, and the
    actor of the driver's own node, are gone within a bound (Ray ends the actors of a dead
    driver; the agents' workers follow them)."""
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), cluster.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        agents = [psutil.Process(int(pid)) for pid in line.split()]
        assert len(agents) == 2, line  # the pool's own node has none: its worker is an actor
        actors = [psutil.Process(int(pid)) for pid in driver.stdout.readline().split()]
        assert len(actors) == 1
        workers = [w for agent in agents for w in agent.children(recursive=True)]
        assert len(workers) >= 2  # the agents' two workers (and each agent's fork server)
    finally:
        driver.kill()
        driver.wait(30)
    left = list(agents + actors + workers)
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        time.sleep(0.2)
    assert not left, [(p.pid, p.name()) for p in left]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def die_then_kill_agent(i: int, died: str, killed: str) -> gymnasium.Env[Any, Any]:
    """CartPole; env 1's worker exits in its 2nd step (once), and its replacement kills the
    node's agent while the agent builds it (once): the agent goes in the middle of a restart."""
    env = gymnasium.make("CartPole-v1")
    if i != 1:
        return env
    if os.path.exists(died) and not os.path.exists(killed):
        open(killed, "w").close()
        for parent in psutil.Process().parents():
            if "NodeAgent" in " ".join(parent.cmdline()):
                parent.kill()
        time.sleep(60)

    class DieOnce(gymnasium.Wrapper[Any, Any, Any, Any]):
        steps = 0

        def step(self, action: Any) -> Any:
            self.steps += 1
            if self.steps == 2 and not os.path.exists(died):
                open(died, "w").close()
                os._exit(1)
            return self.env.step(action)

    return DieOnce(env)


def test_an_agent_lost_during_a_restart_is_replaced_with_its_whole_node(
    cluster: Cluster, tmp_path: Any
) -> None:
    """The agent dies while it rebuilds one of its workers: the pool does not fail on the
    broken connection; a new agent builds the node, every env of it flagged restarted."""
    died, killed = str(tmp_path / "died"), str(tmp_path / "killed")
    fns = [functools.partial(die_then_kill_agent, i, died, killed) for i in range(NUM_ENVS)]
    with envfleet.make(
        fns, backend="ray", num_workers=3, nodes=all_nodes(cluster)[1:], on_error="restart"
    ) as pool:
        pool.reset(seed=0)
        node = pool._transport._where[0][0]  # env 1 is worker 0's
        pid = node.pid
        held = [i for w in node.workers for i in pool._ledger.assignment[w]]
        actions = np.ones(NUM_ENVS, dtype=np.int64)
        restarted = np.zeros(NUM_ENVS, dtype=bool)
        for _ in range(6):
            _, _, _, truncations, infos = pool.step(actions)
            if "envfleet/restarted" in infos:
                now = infos["_envfleet/restarted"]
                assert truncations[now].all()
                restarted |= now
        assert os.path.exists(killed)
        assert np.flatnonzero(restarted).tolist() == held
        assert node.pid != pid


# -- infos as columns --------------------------------------------------------------------------


def test_an_answers_columns_are_joined_by_layout_and_give_back_what_was_sent() -> None:
    """The columns of a node's workers (in any order, two layouts) joined for the wire: one per
    layout, env ids in order, each env's record still its own."""
    sent = [
        {4: {"lives": 1, "frame": 8}, 5: {"lives": 2, "frame": 9}},
        {0: {"lives": 3, "frame": 10}, 1: {"lives": 4, "frame": 11}},
        {2: {"x": 0.5}},
        {6: {"lives": 5, "frame": 12}},
    ]
    parts = [part for infos in sent if (part := info_columns(infos)) is not None]
    joined = node_wire.join_columns(parts)
    assert [columns[0] for columns in joined] == [(0, 1, 4, 5, 6), (2,)]
    back = {i: info for columns in joined for i, info in column_dicts(columns).items()}
    assert back == {i: info for infos in sent for i, info in infos.items()}
    assert node_wire.join_columns(parts[:1]) == parts[:1]


class ArrayInfoShift(InfoShiftEnv):
    """:class:`InfoShiftEnv` whose infos also hold an array every step: they travel as dicts."""

    def _info(self) -> dict[str, Any]:
        info = super()._info()
        info["pos"] = np.arange(2) + self._t
        return info


@pytest.mark.parametrize(
    ("mode", "shared"),
    [
        (AutoresetMode.NEXT_STEP, True),
        (AutoresetMode.SAME_STEP, False),
        (AutoresetMode.DISABLED, False),
    ],
    ids=["NEXT_STEP", "SAME_STEP", "DISABLED"],
)
def test_infos_from_node_agents_are_sync_vector_envs(
    cluster: Cluster, mode: AutoresetMode, shared: bool
) -> None:
    """Infos of plain scalars (columns from the agents) that change keys, order and types
    from step to step, an env whose infos always hold an array (dicts), restarted episodes'
    final infos: SyncVectorEnv's results, infos' values, dtypes and masks included, on three
    nodes (the pool's own node on its memory, its workers' infos dicts, or behind an agent)."""
    fns = [InfoShiftEnv] * 5 + [ArrayInfoShift, InfoShiftEnv]
    assert len(fns) == EQUIVALENCE_ENVS
    reference = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        expected = list(drive(reference, INFO_SHIFT, mode))
    finally:
        reference.close()
    with envfleet.make(
        fns,
        backend="ray",
        num_workers=5,
        nodes=all_nodes(cluster),
        ray_shared_memory=shared,
        autoreset_mode=mode,
    ) as pool:
        assert len(pool.stats().nodes) == 3
        assert_same_run(expected, pool, INFO_SHIFT, mode, f"3 nodes {mode.name}")


def test_async_batches_get_each_envs_infos_from_node_agents(cluster: Cluster) -> None:
    """batch_size < num_envs over two agents of two workers each: each batch's infos are those
    of its envs, in its order (columns and dicts alike)."""
    assert_async_infos(backend="ray", num_workers=4, nodes=all_nodes(cluster)[1:])


class AtariInfos(gymnasium.Env[np.ndarray, np.int64]):
    """A no-op env with Atari's infos every step (reset included): three plain scalars."""

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Box(0, 255, shape=(2,), dtype=np.uint8)
        self.action_space = gymnasium.spaces.Discrete(2)
        self._frame = 0
        self._t = 0

    def _info(self) -> dict[str, Any]:
        return {
            "lives": 3 - self._t // 3,
            "episode_frame_number": np.int64(4 * self._t),
            "frame_number": 4 * self._frame,
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.integers(256, size=2, dtype=np.uint8), self._info()

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._frame += 1
        terminated = self.np_random.random() < 0.2
        obs = np.array([self._t % 256, int(action)], dtype=np.uint8)
        return obs, float(self._t), terminated, False, self._info()


def test_plain_scalar_infos_reach_the_batch_as_columns_with_no_dicts(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Atari's kind of infos from two agents and the actors on the pool's own node: every
    agent's answer is "plain with infos as columns" (never the general pickled one), the
    driver never merges infos env by env nor holds one as a dict, and the results are
    SyncVectorEnv's."""
    case = Case(AtariInfos, steps=30, min_episodes=5)
    reference = SyncVectorEnv([AtariInfos] * EQUIVALENCE_ENVS)
    try:
        expected = list(drive(reference, case, AutoresetMode.NEXT_STEP))
    finally:
        reference.close()
    tags: list[bytes] = []
    take = NodeLink.take

    def spy(self: NodeLink, data: bytes, *args: Any) -> Any:
        tags.append(bytes(data[:1]))
        return take(self, data, *args)

    def merged_env_by_env(*args: Any) -> Any:
        raise AssertionError("the driver merged infos env by env")

    monkeypatch.setattr(NodeLink, "take", spy)
    monkeypatch.setattr(envfleet.results, "merge_infos", merged_env_by_env)
    monkeypatch.setattr(envfleet.infos, "merge_infos", merged_env_by_env)
    with envfleet.make(
        AtariInfos, EQUIVALENCE_ENVS, backend="ray", num_workers=6, nodes=all_nodes(cluster)
    ) as pool:
        assert [n.shared_memory for n in pool.stats().nodes] == [True, False, False]
        pool._ledger.infos = DictsRefused()
        assert_same_run(expected, pool, case, AutoresetMode.NEXT_STEP, "2 agents")
    # One answer per node per round (two if a worker was held past HOLD_LIMIT), every one of
    # them "plain with infos as columns".
    assert len(tags) >= 2 * (case.steps + 1) and set(tags) == {node_wire.INFOS}


class DictsRefused(dict[int, dict[str, Any]]):
    """The ledger's dict infos, refusing any."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"infos reached the driver as dicts: {args}")


# -- infos as columns beside failures, lost workers and async halves ---------------------------


class FailOnce(InfoShiftEnv):
    """:class:`InfoShiftEnv` that, on its ``at``-th step, raises (``"raise"``) or kills its own
    worker process (``"kill"``), ``delay`` seconds in, once for the run (``marker``)."""

    def __init__(self, kind: str = "", at: int = 0, marker: str = "", delay: float = 0.0) -> None:
        super().__init__()
        self.kind, self.at, self.marker, self.delay = kind, at, marker, delay
        self._steps = 0

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self.kind and self._steps == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(self.delay)
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("boom")
        return super().step(action)


def fail_once(kind: str, marker: str, delay: float = 0.0, env: int = 5, at: int = 3) -> list[Any]:
    """Seven :class:`FailOnce` factories: env ``env`` fails on its ``at``-th step."""
    return [
        functools.partial(FailOnce, kind, at, marker, delay) if i == env else FailOnce
        for i in range(EQUIVALENCE_ENVS)
    ]


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("raise", AutoresetMode.SAME_STEP), ("kill", AutoresetMode.NEXT_STEP)],
    ids=["raise-SAME_STEP", "kill-NEXT_STEP"],
)
def test_a_restart_on_a_node_beside_columns_gives_the_process_backends_infos(
    cluster: Cluster, tmp_path: Any, kind: str, mode: AutoresetMode
) -> None:
    """An env of a node's worker raises (its restart's infos dicts) or its worker is killed
    after the node's other worker answered (columns held by the agent), while every other env
    sends columns (the pool's node on its memory, two agents): every result, infos included,
    is the process backend's with the same factories and workers."""
    case = Case(FailOnce, steps=12, min_episodes=1)
    oracle = envfleet.make(
        fail_once(kind, str(tmp_path / "process"), delay=0.3),
        backend="process",
        num_workers=5,
        on_error="restart",
        autoreset_mode=mode,
        seed=SEED,  # restarted envs' seeds derive from it
    )
    try:
        expected = list(drive(oracle, case, mode))
        assert oracle.restarts.tolist() == [0] * 5 + [1, 0]
    finally:
        oracle.close()
    with envfleet.make(
        # env 4 (the node's other worker) answers first: its columns are held by the agent
        fail_once(kind, str(tmp_path / "ray"), delay=0.3),
        backend="ray",
        num_workers=5,
        nodes=all_nodes(cluster),
        on_error="restart",
        autoreset_mode=mode,
        seed=SEED,
    ) as pool:
        assert [n.workers for n in pool.stats().nodes] == [2, 2, 1]
        assert [n.shared_memory for n in pool.stats().nodes] == [True, False, False]
        assert_same_run(expected, pool, case, mode, f"{kind} {mode.name}")
        assert pool.restarts.tolist() == [0] * 5 + [1, 0]


def each_envs_own(pool: envfleet.Pool, steps: int) -> list[list[Any]]:
    """Per env, ``steps + 1`` results (``reset`` first; ``(reward, terminated, truncated,
    info)``) from a pool of ``batch_size=1``: each batch one env, so each info is that env's
    alone (its values as numpy scalars of the dtypes its own values give)."""
    seqs: list[list[Any]] = [[] for _ in range(pool.num_envs)]
    pool.async_reset(seed=SEED)
    while min(map(len, seqs)) <= steps:
        _, rewards, terminations, truncations, infos = pool.recv()
        (i,) = infos.pop("env_id").tolist()
        info = {  # a bool column held Python bools (np.bool_ values: an object column)
            k: v[0].item() if v.dtype == np.bool_ else v[0]
            for k, v in infos.items()
            if k[0] != "_" and infos[f"_{k}"][0]
        }
        seqs[i].append((rewards[0], terminations[0], truncations[0], info))
        if len(seqs[i]) <= steps:
            pool.send(np.zeros(1, dtype=np.int64), [i])
    return seqs


def test_async_halves_on_nodes_hand_out_each_envs_infos_once_beside_a_restart(
    cluster: Cluster, tmp_path: Any
) -> None:
    """batch_size=3 over two agents of two workers each (two halves of a node in flight, rounds
    answered apart), an env restarted on the way: each batch's infos are Gymnasium's merge of
    its envs' own infos at their own step, each handed out once (never twice, never stale),
    as the process backend gives them env by env."""
    rounds = 24
    spare = 4 * rounds  # each env's own results, enough for a long wait on env 5's rebuild
    oracle = envfleet.make(
        fail_once("raise", str(tmp_path / "process")),
        backend="process",
        num_workers=4,
        batch_size=1,
        on_error="restart",
        seed=SEED,
    )
    try:
        alone = each_envs_own(oracle, spare)
    finally:
        oracle.close()
    assert any("envfleet/restarted" in info for *_, info in alone[5])
    taken = [0] * EQUIVALENCE_ENVS
    with envfleet.make(
        fail_once("raise", str(tmp_path / "ray")),
        backend="ray",
        num_workers=4,
        nodes=all_nodes(cluster)[1:],
        batch_size=3,
        on_error="restart",
        seed=SEED,
    ) as pool:
        assert [n.workers for n in pool.stats().nodes] == [2, 2]
        pool.async_reset(seed=SEED)
        done = 0
        # At least ``rounds`` batches, and on until env 5 is past its restart: on a busy
        # machine its rebuild can take many of its neighbours' rounds.
        while done < rounds or taken[5] <= 3:
            done += 1
            assert max(taken) < spare, f"env 5 not back after {done} batches: {taken}"
            _, rewards, terminations, truncations, infos = pool.recv()
            env_ids = infos.pop("env_id").tolist()
            want = [alone[i][taken[i]] for i in env_ids]
            for i in env_ids:
                taken[i] += 1
            where = f"envs {env_ids} at {[taken[i] - 1 for i in env_ids]}"
            np.testing.assert_array_equal(rewards, [w[0] for w in want], err_msg=where)
            np.testing.assert_array_equal(terminations, [w[1] for w in want], err_msg=where)
            np.testing.assert_array_equal(truncations, [w[2] for w in want], err_msg=where)
            assert_same_infos(infos, gymnasium_infos([w[3] for w in want]), where)
            pool.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
        pool.recv()  # the loop ended with env 5 past its restart (or failed naming it)


class Stamped(gymnasium.Env[np.ndarray, np.int64]):
    """Infos that say whose they are: the env's index, a random number drawn when it was
    built, and how many results it has given (plain scalars: columns)."""

    def __init__(self, index: int) -> None:
        self.observation_space = gymnasium.spaces.Box(0, 255, shape=(2,), dtype=np.uint8)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.index, self.build = index, int.from_bytes(os.urandom(7), "little")
        self.results = 0

    def _info(self) -> dict[str, Any]:
        self.results += 1
        return {"env": self.index, "build": self.build, "results": self.results}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(2, np.uint8), self._info()

    def step(self, action: np.int64) -> Any:
        time.sleep(0.002 * self.index)  # so that the envs come back apart
        return np.zeros(2, np.uint8), 1.0, False, False, self._info()


def test_an_agent_lost_with_its_envs_infos_waiting_leaks_no_stale_infos(
    cluster: Cluster,
) -> None:
    """Async batches over two agents; one agent is killed while some of its envs' results (and
    their infos, as columns in the pool's table) wait to be handed out: those go out once, the
    node's envs then come back restarted, and every info after is the rebuilt env's own, in
    sequence (never one handed out twice, nor an earlier one again)."""
    fns = [functools.partial(Stamped, i) for i in range(NUM_ENVS)]
    last: dict[int, tuple[int, int]] = {}  # per env: the build and the count last handed out
    builds: dict[int, int] = {}  # per env: its first build
    restarted = np.zeros(NUM_ENVS, dtype=bool)
    with envfleet.make(
        fns,
        backend="ray",
        num_workers=4,
        nodes=all_nodes(cluster)[1:],
        batch_size=2,
        on_error="restart",
    ) as pool:
        node = pool._transport._nodes[0]
        lost = [i for w in node.workers for i in pool._ledger.assignment[w]]
        table = pool._batch.infos
        killed, waiting = False, set()
        pool.async_reset()
        for _ in range(60):
            _, _, _, truncations, infos = pool.recv()
            env_ids = infos.pop("env_id").tolist()
            none = np.zeros(len(env_ids), dtype=bool)
            flagged, stamped = infos.get("_envfleet/restarted", none), infos.get("_env", none)
            for p, i in enumerate(env_ids):
                if i in waiting:  # its result from before the loss goes out first, as it was
                    assert not flagged[p], f"env {i}: its waiting result was lost"
                    waiting.discard(i)
                if flagged[p]:
                    assert killed and i in lost and truncations[p] and not stamped[p]
                    restarted[i] = True
                    last[i] = (-1, 0)
                    continue
                assert stamped[p], f"env {i}: its infos were lost"
                assert infos["env"][p] == i
                build, results = int(infos["build"][p]), int(infos["results"][p])
                was = last.get(i, (build, 0))
                if was[0] == -1:  # restarted: the rebuilt env's first result, its reset
                    assert build != builds[i] and results == 1, f"env {i}: {build, results}"
                else:
                    want = (was[0], was[1] + 1)
                    assert (build, results) == want, f"env {i}: {build, results}, not {want}"
                last[i] = (build, results)
                builds.setdefault(i, build)
            pool.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
            if not killed and table._has[lost].any():  # its envs' infos wait: kill it
                waiting = {i for i in lost if table._has[i]}
                os.kill(agent_pid(pool, 0), signal.SIGKILL)
                time.sleep(0.5)
                pool._dispatch.pump(block=False)  # the node found lost before they go out
                assert pool.restarts[lost].tolist() == [1] * len(lost)
                killed = True
        pool.recv()
    assert killed, "no infos of the node's envs ever waited"
    assert not waiting
    assert restarted[lost].all() and not restarted[np.setdiff1d(np.arange(NUM_ENVS), lost)].any()


def test_an_agent_counts_its_nodes_cores_not_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's local pool spins for its last replies only while fewer workers owe one than
    its node has cores: those Ray gives the node, never more than the process may run on, the
    machine's where Ray does not know the node. (A live agent on this module's cluster, 1 CPU a
    node, counts 1: checked in :func:`test_agent_socket_refuses_a_wrong_key`, on its agent.)"""
    monkeypatch.setattr(node_agent, "usable_cpus", lambda: (0, 1, 2, 3))
    nodes = [{"NodeID": "a", "Resources": {"CPU": 64.0}}, {"NodeID": "b", "Resources": {}}]
    monkeypatch.setattr(node_agent, "alive_nodes", lambda: nodes)
    assert node_agent.node_cores("a") == 4  # no more than the process may run on
    nodes[0]["Resources"] = {"CPU": 2.0}
    assert node_agent.node_cores("a") == 2
    assert node_agent.node_cores("b") == 1  # at least one
    assert node_agent.node_cores("gone") == 4


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.name)
def test_a_rollout_on_node_agents_is_sync_vector_envs_in_one_message_per_node(
    cluster: Cluster, mode: AutoresetMode
) -> None:
    """``pool.rollout`` on two nodes' agents (two local workers each), in each autoreset mode:
    the policy runs on the nodes, the driver sends one message per node for the whole rollout,
    and the run is SyncVectorEnv's with the same policy, bit for bit (nested observations,
    infos, episodes ending mid-rollout; DISABLED: the rollout resets the envs that ended);
    plain steps and another rollout go on from there."""
    ref = SyncVectorEnv(dict_envs(8), autoreset_mode=mode)
    policy = envfleet.RandomPolicy(ref.single_action_space, POLICY_SEED)
    want, last = reference(ref, policy, "p" * 9 + "f" + "p" * 6)
    ref.close()
    assert sum(int((s["terminations"] | s["truncations"]).sum()) for s in want[:9]) >= 3
    with envfleet.make(
        dict_envs(8),
        backend="ray",
        num_workers=4,
        nodes=all_nodes(cluster)[1:],
        autoreset_mode=mode,
    ) as pool:
        assert isinstance(pool._transport, NodeTransport) and pool._transport._here is None
        policy = envfleet.RandomPolicy(pool.single_action_space, POLICY_SEED)
        pool.reset(seed=SEED_OF_REFERENCE)
        before = [n.messages for n in pool.stats().nodes]
        assert_rollout(pool.rollout(policy, 9), want[:9], "first rollout")
        assert [n.messages for n in pool.stats().nodes] == [b + 1 for b in before]
        assert_step_then_rollout(pool, policy, want, last, 9)


class SlowToRebuild(SlowCartPole):
    """:class:`SlowCartPole` whose builds take ``rebuild`` seconds once ``marker`` exists."""

    def __init__(self, delay: float, marker: str, rebuild: float) -> None:
        if os.path.exists(marker):
            time.sleep(rebuild)
        super().__init__(delay)


def test_a_nodes_slow_replacement_restarts_no_env_of_the_other_nodes(
    cluster: Cluster, tmp_path: Any
) -> None:
    """An agent dies mid-step; its replacement (a new agent through Ray, envs slow to build)
    takes longer than ``step_timeout``, while the other nodes' answers arrive and wait unread.
    They are read before anyone is judged hung: only the lost node's envs restart."""
    timeout = node_step_timeout()
    marker = str(tmp_path / "rebuilding")
    with envfleet.make(
        functools.partial(SlowToRebuild, SLOW_STEP, marker, timeout),
        NUM_ENVS,
        backend="ray",
        num_workers=3,
        nodes=all_nodes(cluster),
        seed=0,
        on_error="restart",
        step_timeout=timeout,
    ) as pool:
        pool.reset()
        node = pool._transport._nodes[0]
        lost = np.zeros(NUM_ENVS, dtype=bool)
        lost[[i for w in node.workers for i in pool._ledger.assignment[w]]] = True
        assert 0 < lost.sum() < NUM_ENVS
        pool.send(np.ones(NUM_ENVS, dtype=np.int64))
        open(marker, "w").close()
        os.kill(agent_pid(pool, 0), signal.SIGKILL)
        _, rewards, _, truncations, infos = pool.recv()
        restarted = infos.get("_envfleet/restarted", np.zeros(NUM_ENVS, dtype=bool))
        assert (restarted == lost).all(), f"restarted {restarted.tolist()}, lost {lost.tolist()}"
        assert (pool.restarts == lost).all(), f"restarts per env: {pool.restarts.tolist()}"
        assert truncations[lost].all() and (rewards[lost] == 0).all()
        assert not truncations[~lost].any() and (rewards[~lost] == 1).all()
        os.remove(marker)
        for _ in range(2):
            _, _, _, _, infos = pool.step(np.ones(NUM_ENVS, dtype=np.int64))
            assert "envfleet/restarted" not in infos
        assert (pool.restarts == lost).all(), f"restarts per env: {pool.restarts.tolist()}"


def test_hosted_vector_envs_on_three_nodes_are_the_vector_envs_alone(cluster: Cluster) -> None:
    """One hosted VectorEnv per worker, a worker per node (the pool's own node too): the
    values, flags and infos of the same VectorEnvs alone; one that raises is rebuilt on its
    node, only its envs flagged."""
    from tests.test_hosted import Alone, assert_same, counting, run

    fns = [
        functools.partial(counting, 2),
        functools.partial(counting, 3, length=4),
        functools.partial(counting, 1, fail_at=6),
    ]
    alone = Alone([fn() for fn in fns])  # five steps: before the third one's failure
    with envfleet.make(
        vector_env_fns=fns, backend="ray", nodes=all_nodes(cluster), seed=2, on_error="restart"
    ) as pool:
        assert len(pool.stats().nodes) == 3
        assert sorted(len(n.env_ids) for n in pool.stats().nodes) == [1, 2, 3]
        got = run(pool, [2, 3, 1], seed=2, steps=5)
        _, rewards, _, truncations, infos = pool.step(np.ones(6, dtype=np.int64))
        assert infos["_envfleet/restarted"].tolist() == [False] * 5 + [True]
        assert truncations[5] and rewards[5] == 0
    want = run(alone, alone.sizes, seed=2, steps=5)
    assert_same(want, got)


@pytest.mark.parametrize("nodes", ["sub-pools", "actors"])
@pytest.mark.parametrize("on_error", ["restart", "raise"])
@pytest.mark.parametrize("fault", ["raise", "exit", "hang"])
def test_a_failed_hosted_vector_env_on_ray_fails_its_block_alone(
    cluster: Cluster, fault: str, on_error: str, nodes: str, tmp_path: Any
) -> None:
    """The hosted failure matrix (tests/test_hosted_faults.py) through Ray, on node sub-pools
    (a worker per node) or an actor per worker: a VectorEnv that raises, whose worker exits,
    that hangs, under both policies."""
    from tests.test_hosted_faults import _pool, check_raised, check_restarted

    marker = str(tmp_path / "failed")
    where = all_nodes(cluster)[1:] if nodes == "sub-pools" else False
    pool = _pool(fault, "ray", on_error, marker, nodes=where)
    try:
        if on_error == "restart":
            check_restarted(pool, marker)
        else:
            check_raised(pool, fault, 1)
    finally:
        pool.close()


@pytest.mark.parametrize("nodes", ["sub-pools", "actors"])
def test_several_hosted_vector_envs_per_ray_worker_are_the_vector_envs_alone(
    cluster: Cluster, nodes: str
) -> None:
    """Four hosted VectorEnvs on two workers (on node sub-pools, or an actor each): each
    worker hosts a contiguous run of two, and the pool gives the values, flags and infos of
    the four alone."""
    from tests.test_hosted import Alone, assert_same, counting, run

    fns = [
        functools.partial(counting, 2),
        functools.partial(counting, 3, length=4),
        functools.partial(counting, 1),
        functools.partial(counting, 2, length=3),
    ]
    alone = Alone([fn() for fn in fns])
    want = run(alone, alone.sizes, seed=2, steps=10)
    where = all_nodes(cluster) if nodes == "sub-pools" else False
    with envfleet.make(
        vector_env_fns=fns, backend="ray", num_workers=2, nodes=where, seed=2
    ) as pool:
        assert [w.env_ids for w in pool.stats().workers] == [tuple(range(5)), (5, 6, 7)]
        got = run(pool, alone.sizes, seed=2, steps=10)
    assert_same(want, got)


class BigLinear:
    """A policy whose weights are 1 MB apart from its code (``weights()``/``load_weights``)."""

    def __init__(self, fill: float) -> None:
        self.w = np.full((4, 2), fill)
        self.big = np.zeros(1 << 17, dtype=np.float64)  # 1 MiB

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w, "big": self.big}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.w, self.big = weights["w"], weights["big"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.asarray(np.argmax(np.asarray(observations) @ self.w, axis=1), dtype=np.int64)


def test_each_versions_weights_cross_to_each_node_once(cluster: Cluster) -> None:
    """Two nodes of two workers each: a new version's weights (1 MiB) go to each node once,
    whatever its workers; the code once; the same weights again, not at all; the versions
    stamped are those the pool counted."""
    policy = BigLinear(0.5)
    with envfleet.make(
        "CartPole-v1", 8, backend="ray", num_workers=4, nodes=all_nodes(cluster)[1:], seed=0
    ) as pool:
        pool.reset()

        def sent() -> list[int]:
            return [n.bytes_out for n in pool.stats().nodes]

        before = sent()
        assert pool.rollout_async(policy, 2) == 1
        first = pool.rollout_wait()
        code = [a - b for a, b in zip(sent(), before, strict=True)]
        policy.w = np.full((4, 2), -0.5)
        before = sent()
        assert pool.rollout_async(policy, 2) == 2
        second = pool.rollout_wait()
        per_version = [a - b for a, b in zip(sent(), before, strict=True)]
        before = sent()
        assert pool.rollout_async(policy, 2) == 2  # the same weights: nothing to send
        pool.rollout_wait()
        again = [a - b for a, b in zip(sent(), before, strict=True)]
    mib = 1 << 20
    assert all(mib < c < 2.2 * mib for c in code), code  # code and weights, once per node
    assert all(mib < v < 1.1 * mib for v in per_version), per_version
    assert all(a < 0.05 * mib for a in again), again
    assert (first.policy_versions == 1).all() and (second.policy_versions == 2).all()
