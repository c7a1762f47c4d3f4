"""The pool's own node in a pool of node sub-pools: its workers share the pool's memory.

A node sub-pool elsewhere sends its rows over a socket (:mod:`envfleet.backends.nodes.link`);
on the node the pool's process runs on, that would be a copy for nothing. There the workers are
the ray backend's same-machine actors instead
(:class:`~envfleet.backends.ray.transport.RayTransport`, pinned to this node): they map the
pool's batch memory, write their rows in place and take each command over a Unix socket, as a
pool of one actor per worker does on its own node.

:class:`DriverNode` holds that transport for the pool's workers on this node (its worker ``k``
is the pool's ``workers[k]``), and keeps the descriptors of its sockets registered in the node
transport's poller, so that one ``poll`` waits on the agents' connections and on these sockets
together.
"""

from __future__ import annotations

import dataclasses
import select
from collections.abc import Sequence

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envfleet.backends.contract.base import Replies, TransportOptions
from envfleet.backends.nodes.options import NodeOptions
from envfleet.backends.ray import memory as node_memory
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.session import pool_node
from envfleet.backends.ray.transport import RayTransport
from envfleet.buffers import Batch
from envfleet.protocol import Command
from envfleet.stats import NodeStats

_RESERVES = frozenset({"num_cpus", "num_gpus", "memory", "resources", "accelerator_type"})
"""The keys of ``.options()`` that reserve a node's resources."""


def shared_node(extra: RayOptions) -> str | None:
    """The Ray node of the pool's process, whose workers share its memory (``None``: they do
    not: ``ray_shared_memory=False``, no anonymous memory files, or a Ray Client connection,
    whose process is on no node)."""
    if not extra.ray_shared_memory or not node_memory.available():
        return None
    return pool_node()


def driver_options(
    options: TransportOptions, workers: Sequence[int], node_id: str, extra: RayOptions
) -> NodeOptions:
    """``options`` for the pool's ``workers`` on its own node ``node_id``: one actor each,
    pinned there, whose envs keep their global indices (rows of the whole pool's batch).

    The actors reserve none of the node's resources: ``worker_resources`` are what each node's
    agent asks for, once per node, and a node is chosen only if it has them; this node's
    workers, like an agent's worker processes, come on top."""
    resources = {k: v for k, v in extra.worker_resources.items() if k not in _RESERVES}
    resources["num_cpus"] = 0
    resources["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    pinned = dataclasses.replace(extra, worker_resources=resources, nodes=False, compress=None)
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    values["assignment"] = [tuple(options.assignment[w]) for w in workers]
    values["backend_options"] = pinned
    return NodeOptions(**values, rows=options.num_envs)


class DriverNode:
    """The pool's workers on its own node, as one Ray actor each on the pool's memory."""

    def __init__(
        self,
        options: TransportOptions,
        workers: list[int],
        node_id: str,
        extra: RayOptions,
        poller: select.poll,
    ) -> None:
        self.workers = workers
        self.node_id = node_id
        self.host = ""
        self._assignment = options.assignment
        self._poller = poller
        self._fds: set[int] = set()
        self.messages = 0  # commands sent (one per worker each)
        self.answers = 0
        self.transport = RayTransport(driver_options(options, workers, node_id, extra))
        self.batch: Batch = self.transport.batch
        self._sync()

    def owns(self, fd: int) -> bool:
        return fd in self._fds

    def busy(self) -> bool:
        """Whether a reply may come without an event on a socket (see
        :meth:`RayTransport.busy`): the pool must then look every millisecond or so."""
        return self.transport.busy()

    def _sync(self) -> None:
        """Register the sockets of the actors now in the poller, and only those."""
        fds = set(self.transport.sockets())
        for fd in self._fds - fds:
            try:
                self._poller.unregister(fd)
            except (KeyError, ValueError):
                pass
        for fd in fds - self._fds:
            self._poller.register(fd, select.POLLIN)
        self._fds = fds

    def prepare(self, local: int, command: Command) -> None:
        self.transport.prepare(local, command)

    def submit(self, local: int, command: Command) -> None:
        self.messages += 1
        self.transport.submit(local, command)

    def wait(self) -> Replies:
        """The replies in now (the pool's worker indices), rows in place."""
        replies = self.transport.wait(0.0)
        self._sync()  # a socket closed: its actor is lost
        self.answers += len(replies)
        workers = self.workers
        return [(workers[local], reply) for local, reply in replies]

    def kill(self, local: int) -> None:
        self.transport.kill(local)

    def restart(self, local: int, restarts: dict[int, int]) -> None:
        try:
            self.transport.restart(local, restarts)
        finally:
            self._sync()

    def memory(self, local: int) -> int | None:
        return self.transport.memory(local)

    def stats(self) -> NodeStats:
        """The node's layout (its workers and their envs) and the commands it took."""
        env_ids = tuple(i for w in self.workers for i in self._assignment[w])
        return NodeStats(
            node=self.node_id,
            address=self.host,
            workers=len(self.workers),
            envs=len(env_ids),
            messages=self.messages,
            answers=self.answers,
            bytes_out=0,
            bytes_in=0,
            round_trip_ms=None,
            shared_memory=True,
            worker_ids=tuple(self.workers),
            env_ids=env_ids,
        )

    def forked(self) -> None:
        self.transport.forked()

    def close(self, timeout: float) -> None:
        try:
            self.transport.close(timeout)
        finally:
            for fd in self._fds:
                try:
                    self._poller.unregister(fd)
                except (KeyError, ValueError):
                    pass
            self._fds = set()


__all__ = ["DriverNode", "driver_options", "shared_node"]
