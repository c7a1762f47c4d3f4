"""The pool's node agents as Ray actors: placed on their nodes, started, connected to, started
again for a lost node, and ended.

:class:`AgentActors` spawns each node's :class:`~envfleet.backends.nodes.agent.NodeAgent`
(pinned to its node with ``NodeAffinitySchedulingStrategy``; a replacement wherever Ray finds
room), waits for its workers to start within ``start_timeout`` and connects to it over TCP
(:func:`connect_agent`: ``multiprocessing``'s challenge with the pool's key, both ways). When
the pool closes, :func:`ask_to_close` asks every agent to close its workers and
:func:`end_agents` kills what is left, waits for this machine's agent processes
(:func:`local_agents`) and removes what they left behind.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envfleet.backends.contract.base import TransportOptions
from envfleet.backends.contract.connections import handshake
from envfleet.backends.nodes import raw_rows, wire
from envfleet.backends.nodes.agent import NodeAgent, remove_dead_agents_dirs
from envfleet.backends.nodes.frames import Frames
from envfleet.backends.nodes.link import NodeLink
from envfleet.backends.nodes.options import node_options
from envfleet.backends.ray.ended import bury
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.session import START_ATTEMPTS, await_start
from envfleet.errors import EnvTimeoutError

__all__ = [
    "CONNECT_TIMEOUT",
    "AgentActors",
    "ask_to_close",
    "bury",
    "connect_agent",
    "end_agents",
    "local_agents",
]

CONNECT_TIMEOUT = 30.0
"""Seconds the pool gives an agent's socket to accept it and prove the key (the connection and
the whole handshake)."""


class AgentActors:
    """Starts the agents of a pool's nodes and connects to them; ``connected`` is told of each
    node once its connection is up (the transport polls it from then on)."""

    def __init__(
        self,
        options: TransportOptions,
        extra: RayOptions,
        authkey: bytes,
        connected: Callable[[NodeLink], None],
    ) -> None:
        self._options = options
        self._authkey = authkey
        self._connected = connected
        self._agent_cls = ray.remote(NodeAgent)
        self._resources = dict(extra.worker_resources)
        self._resources.setdefault("num_cpus", 0)

    def spawn(
        self,
        node: NodeLink,
        restarts: dict[int, int],
        soft: bool,
        rows: list[np.ndarray] | None = None,
    ) -> None:
        """A new agent for ``node`` with ``restarts`` (per env), on its node (``soft``: or
        wherever Ray finds room); ``rows``: its envs' rows as the pool has them (see
        :meth:`rebuild`)."""
        node.spawned = (restarts, soft, rows)
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=soft)
        node.agent = self._agent_cls.options(
            max_concurrency=1, max_restarts=0, scheduling_strategy=strategy, **self._resources
        ).remote(node_options(self._options, node.workers), restarts, rows)
        node.started()

    def _respawn(self, node: NodeLink) -> Any:
        """Another agent for ``node`` (the last one died starting, placed on a node that just
        died): wherever Ray finds room; its start call's ref."""
        restarts, _, rows = node.spawned
        self.spawn(node, restarts, soft=True, rows=rows)
        return node.agent.start.remote(self._authkey)

    def start(self, nodes: Sequence[NodeLink]) -> None:
        """Wait until each of ``nodes`` has started its workers, then connect to it."""
        timeout = self._options.start_timeout
        deadline = time.monotonic() + timeout
        started = [(node, node.agent.start.remote(self._authkey)) for node in nodes]
        for node, ref in started:
            try:
                error, node_id, host, port, pid = await_start(
                    ref, deadline, functools.partial(self._respawn, node)
                )
            except GetTimeoutError as exc:
                node.kill_agent()
                raise node.start_failed(
                    self._options.assignment,
                    f"did not start within start_timeout={timeout:g}s",
                    EnvTimeoutError,
                ) from exc
            except RayError as exc:
                raise node.start_failed(
                    self._options.assignment,
                    f"died while starting ({START_ATTEMPTS} agents in a row): {exc}",
                ) from exc
            if error is not None:
                node.kill_agent()
                raise wire.rebuild(error, node.workers, self._options.spec.name)
            node.node_id, node.host, node.pid = node_id, host, pid
            node.serving = node.agent.serve.remote()
            try:
                node.conn = connect_agent(host, port, self._authkey)
            except (OSError, EOFError, AuthenticationError) as exc:
                node.kill_agent()
                raise node.start_failed(
                    self._options.assignment, f"could not be reached at {host}:{port}"
                ) from exc
            node.frames = Frames(node.conn.fileno())
            node.alive, node.lost = True, False
            self._connected(node)

    def rebuild(
        self,
        node: NodeLink,
        worker: int,
        restarts: dict[int, int],
        counts: np.ndarray,
        fields: Sequence[np.ndarray],
    ) -> None:
        """A new agent for the whole of lost ``node``, as ``worker`` restarts with
        ``restarts``: its other workers were reported lost too and will be restarted with one
        more restart each (``counts``: each env's restarts so far), as the pool's recovery
        counts them; their restarts are then already done (``node.rebuilt``).

        The new agent's envs start from their rows in the pool's batch (``fields``, as
        :func:`~envfleet.backends.nodes.raw_rows.row_fields` lists them): the latest the pool
        holds, where the lost agent's memory held the rows it had not sent yet. A restarted
        env's truncation keeps its latest observation (a rollout's first row), as on one
        machine, whose workers' rows outlive them in its shared memory."""
        assignment = self._options.assignment
        sel = raw_rows.selection(np.array(node.env_ids(assignment), dtype=np.intp))
        rows = [np.array(field[sel]) for field in fields]
        after = {
            i: int(counts[i]) + (0 if w == worker else 1)
            for w in node.workers
            for i in assignment[w]
        }
        after.update(restarts)
        node.rebuilt = {k: {i: after[i] for i in assignment[w]} for k, w in enumerate(node.workers)}
        self.spawn(node, after, soft=True, rows=rows)
        self.start([node])


def ask_to_close(nodes: Sequence[NodeLink], deadline: float) -> None:
    """Ask each live agent of ``nodes`` to close its workers and wait, until ``deadline``
    (``time.monotonic``), for their serving calls to return."""
    for node in nodes:
        if node.alive and node.conn is not None:
            try:
                node.conn.send_bytes(wire.CLOSE)
            except OSError:
                pass
    serving = [n.serving for n in nodes if n.alive and n.serving is not None]
    if serving and ray.is_initialized():
        try:
            ray.wait(
                serving, num_returns=len(serving), timeout=max(0.0, deadline - time.monotonic())
            )
        except Exception:
            pass


def end_agents(nodes: Sequence[NodeLink], here: list[psutil.Process], timeout: float) -> None:
    """Close the connections to ``nodes`` and kill their agents; ``ray.kill`` returns at once:
    the agents' processes on this machine (``here``, with their workers) end within
    ``timeout`` more, or are ended; then what they left in the temp dir goes."""
    for node in nodes:
        node.disconnect()
        node.alive = False
        if ray.is_initialized():
            node.kill_agent()
    bury(here, timeout)
    remove_dead_agents_dirs()


def local_agents(nodes: Sequence[NodeLink]) -> list[psutil.Process]:
    """The processes of ``nodes``' agents that run on this machine, and theirs (the agent's fork
    server, its workers): what ``close`` waits for after killing the agents."""
    if not ray.is_initialized():
        return []
    here = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    out: list[psutil.Process] = []
    for node in nodes:
        if node.pid <= 0 or node.host != here:
            continue
        try:
            agent = psutil.Process(node.pid)
            # Its own, not a process that took its pid since it ended.
            if "NodeAgent" not in agent.name() + " ".join(agent.cmdline()):
                continue
            out += [agent, *agent.children(recursive=True)]
        except psutil.Error:
            continue
    return out


def connect_agent(
    host: str, port: int, authkey: bytes, timeout: float = CONNECT_TIMEOUT
) -> Connection:
    """A connection to an agent that proved it knows ``authkey`` (and to which we proved it),
    the connection and the whole handshake within ``timeout`` seconds.

    Raises:
        AuthenticationError: either side's key was wrong.
        OSError, EOFError: nothing answered in time (``TimeoutError``), or the connection
            broke.
    """
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake(sock, authkey, deadline - time.monotonic(), accepting=False)
        return Connection(sock.detach())
    finally:
        sock.close()  # a no-op once detached
