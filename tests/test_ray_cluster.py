"""The ray backend on a multi-node cluster, all on this machine (``ray.cluster_utils.Cluster``).

One actor per worker (``nodes=False``; node sub-pools, the default on a cluster, are
``tests/test_ray_nodes.py``'s). A head and two worker nodes that carry a custom resource
(``sim``); the pools ask for it, so their actors go on the worker nodes only, spread over both.
Removing a node mid-run gives :class:`~envfleet.WorkerDiedError` under ``on_error="raise"``;
under ``"restart"`` the run goes on, the envs of that node reporting a truncated episode with
``infos["envfleet/restarted"]``. Never a hang. The cluster is shared by the module (it takes
seconds to start); a test that removes a node adds a fresh one back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import envfleet
from envfleet.backends.ray.session import loopback
from tests.ray_helpers import no_node_leaks

__all__ = ["no_node_leaks"]  # fixtures, used by name

NUM_ENVS = 8
NUM_WORKERS = 4  # 2 envs each
RESOURCE = "sim"
ONE_PER_NODE = "slot"
"""Every node, the head included, has one: three actors asking for one land one per node."""
WORKER_NODE = {
    "num_cpus": 1,
    "resources": {RESOURCE: NUM_WORKERS, ONE_PER_NODE: 1},
    "object_store_memory": 80 << 20,
}
"""Each worker node can hold every actor of a pool (so one can take over from the other)."""
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}
"""Ray notices a node killed without warning by missed health checks: here one a second, four
missed in a row (about 5 s; its defaults took about 15 s). A check waits Ray's usual timeout for
its reply, so a node merely slow on a loaded machine is not declared dead."""
DETECT_WITHIN = 60.0
"""Seconds a node's death may take to surface."""
ACTIONS = np.ones(NUM_ENVS, dtype=np.int64)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    assert not ray.is_initialized()
    with loopback():  # every node on 127.0.0.1: no test traffic on the machine's address
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "resources": {ONE_PER_NODE: 1},
                "include_dashboard": False,
                "object_store_memory": 80 << 20,
                "_system_config": HEALTH_CHECKS,
            },
        )
    try:
        with loopback():
            for _ in range(2):
                cluster.add_node(**WORKER_NODE)
            ray.init(address=cluster.address, log_to_driver=False)
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def make_pool(**kwargs: Any) -> envfleet.Pool:
    return envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        backend="ray",
        num_workers=NUM_WORKERS,
        worker_resources={"resources": {RESOURCE: 1}},
        nodes=False,  # one actor per worker (the default would run a sub-pool per node)
        seed=0,
        **kwargs,
    )


def worker_node_ids(cluster: Cluster) -> set[str]:
    return {node.node_id for node in cluster.worker_nodes}


def test_actors_spread_over_both_worker_nodes(cluster: Cluster) -> None:
    with make_pool() as pool:
        nodes = pool._transport.node_ids()
        assert set(nodes) == worker_node_ids(cluster), "not on both worker nodes (or on the head)"
        pool.reset()
        for _ in range(5):
            pool.step(ACTIONS)


def test_actors_on_the_pools_node_use_its_memory_the_others_ray_calls(cluster: Cluster) -> None:
    """One actor per node: the head's (the pool's node) takes commands over its socket, the two
    on worker nodes by Ray calls; one pool waits on both kinds and matches the serial backend,
    sync and async."""
    actions = np.random.default_rng(0).integers(0, 2, size=(40, 6))
    kwargs: dict[str, Any] = {"seed": 0, "autoreset_mode": "SameStep"}
    with envfleet.make("CartPole-v1", 6, backend="serial", **kwargs) as serial:
        expected = [serial.reset()] + [serial.step(a) for a in actions]
    with envfleet.make(
        "CartPole-v1",
        6,
        backend="ray",
        num_workers=3,
        worker_resources={"resources": {ONE_PER_NODE: 1}},
        nodes=False,
        **kwargs,
    ) as pool:
        transport = pool._transport
        head = cluster.head_node.node_id
        assert sorted(transport.node_ids()) == sorted([head, *worker_node_ids(cluster)])
        assert transport.same_machine() == [node == head for node in transport.node_ids()]
        got = [pool.reset()] + [pool.step(a) for a in actions]
    for k, (want, have) in enumerate(zip(expected, got, strict=True)):
        for field, (x, y) in enumerate(zip(want[:-1], have[:-1], strict=True)):
            np.testing.assert_array_equal(x, y, err_msg=f"step {k} field {field}")
    with envfleet.make(
        "CartPole-v1",
        6,
        backend="ray",
        num_workers=3,
        batch_size=2,
        worker_resources={"resources": {ONE_PER_NODE: 1}},
        nodes=False,
        **kwargs,
    ) as pool:
        pool.async_reset()
        seen = np.zeros(6, dtype=np.int64)
        # First ready first: the head's actor may answer many times before a Ray call's
        # first reply on a busy machine, so the loop runs until every env has come back
        # (at least 60 batches), bounded in time, not in batches.
        deadline, batches = time.monotonic() + 60.0, 0
        while (batches < 60 or not (seen > 0).all()) and time.monotonic() < deadline:
            _, _, _, _, infos = pool.recv()
            ids = infos["env_id"]
            seen[ids] += 1
            batches += 1
            pool.send(np.ones(len(ids), dtype=np.int64), ids)
        assert (seen > 0).all(), f"an env never came back in 60 s: {seen}"


def remove_node_of_worker(cluster: Cluster, pool: envfleet.Pool, worker: int, **kwargs: Any) -> Any:
    """Remove the node that runs ``worker``'s actor; return the workers that were on it."""
    nodes = pool._transport.node_ids()
    (victim,) = [node for node in cluster.worker_nodes if node.node_id == nodes[worker]]
    cluster.remove_node(victim, **kwargs)
    return [w for w, node in enumerate(nodes) if node == victim.node_id]


@pytest.fixture
def replace_removed_node(cluster: Cluster) -> Iterator[None]:
    """Add a fresh worker node after the test for each one it removed."""
    count = len(cluster.worker_nodes)
    yield
    while len(cluster.worker_nodes) < count:
        with loopback():
            cluster.add_node(**WORKER_NODE)


def test_node_removed_mid_run_raises_worker_died(
    cluster: Cluster, replace_removed_node: None
) -> None:
    with make_pool(on_error="raise") as pool:
        pool.reset()
        pool.step(ACTIONS)
        lost = remove_node_of_worker(cluster, pool, worker=0)
        start = time.monotonic()
        with pytest.raises(envfleet.WorkerDiedError) as info:
            while time.monotonic() - start < DETECT_WITHIN:
                pool.step(ACTIONS)
        assert info.value.worker in lost
        assert info.value.phase is envfleet.Phase.STEP
        with pytest.raises(envfleet.BrokenPoolError):
            pool.step(ACTIONS)


def test_node_killed_mid_run_restarts_its_envs(
    cluster: Cluster, replace_removed_node: None
) -> None:
    """The node is killed without warning (no graceful shutdown) and the run goes on."""
    with make_pool(on_error="restart") as pool:
        pool.reset()
        pool.step(ACTIONS)
        lost = remove_node_of_worker(cluster, pool, worker=0, allow_graceful=False)
        lost_envs = np.isin(np.arange(NUM_ENVS), [2 * w + k for w in lost for k in (0, 1)])
        restarted = np.zeros(NUM_ENVS, dtype=bool)
        start = time.monotonic()
        while time.monotonic() - start < DETECT_WITHIN:
            _, rewards, _, truncations, infos = pool.step(ACTIONS)
            if "envfleet/restarted" in infos:
                now = infos["_envfleet/restarted"]
                assert truncations[now].all() and (rewards[now] == 0).all()
                assert not (restarted & now).any(), "an env restarted twice"
                restarted |= now
            if (restarted == lost_envs).all():
                break
        assert (restarted == lost_envs).all(), f"restarted {restarted}, expected {lost_envs}"
        assert (pool.restarts == lost_envs).all()
        survivors = worker_node_ids(cluster)
        assert set(pool._transport.node_ids()) <= survivors, "an actor on a dead node"
        for _ in range(5):
            _, _, _, _, infos = pool.step(ACTIONS)
            assert "envfleet/restarted" not in infos
