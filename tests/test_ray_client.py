"""The ray backend over a Ray Client connection (``ray://``) to a cluster of two nodes.

A head and a worker node of ``ray.cluster_utils.Cluster``, the head running Ray's client server
(``ray_client_server_port``), shared by the module. Over the client the pool's process is on no
node of the cluster, though Ray answers ``get_node_id()`` with the node of the server's process:
the pool must not take the node sub-pool path (the agents' sockets and the nodes' memory are out
of its reach) but run one actor per worker, each command a Ray call, with the trajectories of
``SyncVectorEnv``; asked for node sub-pools, it refuses before anything starts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import gymnasium
import numpy as np
import psutil
import pytest
import ray
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from ray.cluster_utils import Cluster

import envfleet
from envfleet.backends.ray import session as ray_session
from envfleet.backends.ray.transport import RayTransport
from tests import ray_helpers

T = TypeVar("T")
NUM_ENVS = 4
NUM_WORKERS = 2
STEPS = 30
SEED = 3
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
CONNECT_TIMEOUT = 180.0
"""The head starts a server process for each client connection: seconds on a busy machine."""


@pytest.fixture(autouse=True)
def no_leaked_processes_or_shared_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Overrides conftest.py's: the nodes' daemons belong to the module's cluster, and so does
    the server process the head's client server starts for each client connection (kept a
    while after the client leaves, should it come back); no actor of a closed pool may outlive
    its test."""
    ray_daemon = ray_helpers._is_ray_daemon

    def of_the_cluster(child: psutil.Process) -> bool:
        try:
            if any("ray.util.client.server" in part for part in child.cmdline()):
                return True
        except psutil.Error:
            return True  # already gone
        return ray_daemon(child)

    monkeypatch.setattr(ray_helpers, "_is_ray_daemon", of_the_cluster)
    yield from ray_helpers.ray_leak_check(ray_daemons_too=False)


@pytest.fixture(scope="module")
def client_address() -> Iterator[str]:
    """``ray://127.0.0.1:<port>`` of a two-node cluster's client server. Not on loopback only
    (``loopback()``): the server process the client gets must reach the GCS at the head's
    address."""
    assert not ray.is_initialized()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "include_dashboard": False, "ray_client_server_port": port},
    )
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield f"ray://127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


SERVER_START_FAILED = ("Starting Ray client server failed", "start_specific_server")
"""Ray's errors when the head's client server could not start the server process of a client
(the process exits as it starts: Ray says so, or its proxier's ``start_specific_server`` trips
over the process gone zombie); the connection is tried again."""


def with_retries(connect: Callable[[], T], attempts: int = 3) -> T:
    """``connect()``, tried again where Ray's client server failed to start the client's server
    process (:data:`SERVER_START_FAILED`), and only there."""
    for attempt in range(1, attempts + 1):
        try:
            return connect()
        except ConnectionError as exc:
            text = f"{exc} {exc.__cause__}"
            if attempt == attempts or not any(sign in text for sign in SERVER_START_FAILED):
                raise
    raise AssertionError("unreachable")


def reference() -> list[np.ndarray]:
    envs = SyncVectorEnv(
        [lambda: gymnasium.make("CartPole-v1") for _ in range(NUM_ENVS)],
        autoreset_mode=AutoresetMode.NEXT_STEP,
    )
    try:
        return run(envs)
    finally:
        envs.close()


def run(envs: Any) -> list[np.ndarray]:
    obs, _ = envs.reset(seed=SEED)
    seen = [np.array(obs)]
    actions = np.random.default_rng(0).integers(0, 2, size=(STEPS, NUM_ENVS))
    for step in range(STEPS):
        obs, rewards, terminations, truncations, _ = envs.step(actions[step])
        seen += [np.array(obs), np.array(rewards), np.array(terminations | truncations)]
    return seen


def assert_one_actor_per_worker_over_ray_calls(pool: envfleet.Pool) -> None:
    transport = pool._transport
    assert isinstance(transport, RayTransport), type(transport).__name__
    assert transport._memory is None  # the pool's memory is on no node
    assert transport.same_machine() == [False] * NUM_WORKERS  # every command a Ray call
    assert pool.stats().nodes == ()
    assert "nodes=" not in repr(pool)
    for got, want in zip(run(pool), reference(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_pool_that_connects_through_ray_client_runs_one_actor_per_worker(
    client_address: str,
) -> None:
    """``address="ray://..."``: the pool makes the connection, and closes it with the pool."""
    with with_retries(
        lambda: envfleet.make(
            "CartPole-v1",
            NUM_ENVS,
            backend="ray",
            address=client_address,
            connect_timeout=CONNECT_TIMEOUT,
            num_workers=NUM_WORKERS,
            autoreset_mode=AutoresetMode.NEXT_STEP,
        )
    ) as pool:
        assert ray_session.client_connected()
        # Ray answers with the node of the client server's process, which is not this one.
        assert ray.get_runtime_context().get_node_id() is not None
        assert ray_session.pool_node() is None
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # node sub-pools' ground
        assert_one_actor_per_worker_over_ray_calls(pool)
    assert not ray.is_initialized()  # its own connection, let go of with the pool


def test_a_callers_ray_client_connection_is_detected_and_left_open(client_address: str) -> None:
    """Connected by the caller (``ray.init("ray://...")``): the pool sees the client itself,
    refuses node sub-pools before starting anything, and leaves the connection open."""
    with_retries(lambda: ray.init(client_address))
    try:
        with pytest.raises(ValueError, match="Ray Client"):
            envfleet.make("CartPole-v1", NUM_ENVS, backend="ray", nodes="auto")
        with envfleet.make(
            "CartPole-v1",
            NUM_ENVS,
            backend="ray",
            num_workers=NUM_WORKERS,
            autoreset_mode=AutoresetMode.NEXT_STEP,
        ) as pool:
            assert_one_actor_per_worker_over_ray_calls(pool)
        assert ray.is_initialized()
    finally:
        ray.shutdown()
