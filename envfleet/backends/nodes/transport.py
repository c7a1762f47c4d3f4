"""The Ray backend across nodes: one sub-pool per node, one message per node per command.

::

    pool (driver)                 node A: NodeAgent (Ray actor)        node B: NodeAgent ...
    ─────────────                 ─────────────────────────────
    submit_all(step) ── 1 msg ──► local ProcessTransport ─ pipes ─► worker processes
      (actions of A's envs)        (shared memory of node A)          (EnvGroup, global ids)
    wait: poll the nodes' ◄── 1 msg (rows of all of A's envs) ──
      sockets; rows land with one slice assignment per field

Ray places one :class:`~envfleet.backends.nodes.agent.NodeAgent` on each chosen node (pinned:
:mod:`~envfleet.backends.nodes.actors`), watches it and kills it; the data goes over a TCP
connection between the pool and each agent (on the node's Ray address, opened with a per-pool
secret handed to the agent through Ray, ``multiprocessing``'s challenge). The pool's workers are
laid over the nodes in contiguous runs, so a node's envs are consecutive rows: its rows arrive as
the raw bytes of each field, written with one slice assignment each, no Python per env; a
rollout's parts are read straight into the rollout's columns (:meth:`NodeTransport.land`).

Which nodes, and how many workers on each, is :mod:`~envfleet.backends.nodes.placement`'s; each
agent as the pool sees it (its connection, what it owes, a round each way) a
:class:`~envfleet.backends.nodes.link.NodeLink`; this transport routes the commands, waits on
the nodes, and is its own workers' lifecycle (kills, restarts). A node whose agent dies (or is
killed: it did not stop a hung worker when asked) loses all its workers, each reported lost (a
:class:`~envfleet.backends.contract.base.WorkerLost` naming the node); under
``on_error="restart"`` the first restart asks for a new agent (on the same node when Ray still
has it, else wherever Ray finds room), which builds all that node's envs restarted.
"""

from __future__ import annotations

import contextlib
import pickle
import secrets
import select
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    Replies,
    TransportOptions,
    WorkerLost,
)
from envfleet.backends.nodes import compression, raw_rows, wire
from envfleet.backends.nodes.actors import AgentActors, ask_to_close, end_agents, local_agents
from envfleet.backends.nodes.driver_node import DriverNode, shared_node
from envfleet.backends.nodes.frames import SEND_TIMEOUT, Message, SendTimeout, send
from envfleet.backends.nodes.link import NodeLink
from envfleet.backends.nodes.placement import choose_nodes, place, split_here
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.session import connect, disconnect, forked
from envfleet.buffers import Batch
from envfleet.errors import EnvTimeoutError
from envfleet.protocol import Command, Sample
from envfleet.rollout_loop import Sampled
from envfleet.stats import NodeStats, env_range

__all__ = ["NodeTransport", "open_transport"]


class NodeTransport(BaseTransport, BaseWorkers):
    """One agent per node; each node's commands and replies travel as one message."""

    def __init__(self, options: TransportOptions) -> None:
        extra = options.backend_options
        if not isinstance(extra, RayOptions):
            extra = RayOptions()
        self._options = options
        self._closed = False
        # A node's command goes as the agent takes it: past this long without it taking a
        # byte, the agent is stopped or unreachable, and its node is lost.
        self._send_timeout = SEND_TIMEOUT if options.step_timeout is None else options.step_timeout
        codec = compression.codec(extra.compress)
        raw_rows.check_compress(extra.compress, codec, options)
        self._connected = connect(extra.address, dict(extra.ray_init_kwargs))
        self._space = options.observation_space
        self._authkey = secrets.token_bytes(32)
        self._nodes: list[NodeLink] = []
        self._here: DriverNode | None = None  # the pool's workers on its own node
        # Per global worker: its node's link (None: on the pool's own node) and its index there.
        self._where: list[tuple[NodeLink | None, int]] = []
        self._poller = select.poll()
        self._by_fd: dict[int, NodeLink] = {}
        self._queued: Replies = []
        self._restarts = np.zeros(options.num_envs, dtype=np.int64)
        try:
            wanted = extra.nodes if isinstance(extra.nodes, (str, tuple)) else "auto"
            chosen = choose_nodes(wanted, dict(extra.worker_resources))
            runs = place(chosen, len(options.assignment))
            here = shared_node(extra)
            here_workers, others = split_here(chosen, runs, here)
            self._nodes = [NodeLink(k, node_id, run) for k, (node_id, run) in enumerate(others)]
            where: dict[int, tuple[NodeLink | None, int]]
            where = {w: (None, k) for k, w in enumerate(here_workers)}
            for node in self._nodes:
                where.update((w, (node, k)) for k, w in enumerate(node.workers))
            self._where = [where[w] for w in range(len(options.assignment))]
            self._actors = AgentActors(options, extra, self._authkey, self._connected_to)
            for node in self._nodes:
                self._actors.spawn(node, {}, soft=False)
            if here_workers:  # its actors start while the agents do
                assert here is not None
                self._here = DriverNode(options, here_workers, here, extra, self._poller)
                self._here.host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
            self.batch = (
                self._here.batch
                if self._here is not None
                else Batch.local(options.observation_space, options.action_space, options.num_envs)
            )
            self._rows = raw_rows.row_fields(self.batch)
            self._codecs = raw_rows.row_codecs(self._rows, codec)
            self._actions = raw_rows.action_fields(self.batch)
            self._actors.start(self._nodes)
        except BaseException:
            self.close(1.0)
            raise

    def _connected_to(self, node: NodeLink) -> None:
        """``node``'s agent is connected: its messages are waited on from now on."""
        assert node.conn is not None
        self._by_fd[node.conn.fileno()] = node
        self._poller.register(node.conn.fileno(), select.POLLIN)

    # -- what the pool sees --------------------------------------------------------------------

    def memory(self, worker: int) -> int | None:
        """Resident bytes of ``worker``'s process as its agent last reported them (``None``:
        not yet, or gone); a call asks the node for fresh figures when it answered the last
        ask, so a later check of ``worker_memory_limit`` sees them, without a wait here."""
        node, local = self._where[worker]
        if node is None:  # on the pool's own node: its actor's, read here
            assert self._here is not None
            return self._here.memory(local)
        try:
            return node.measured(local)
        except OSError:
            self._lose(node, "its connection broke")
            return None

    def node_ids(self) -> list[str]:
        """The Ray node of each worker, in the workers' order (as :meth:`nodes` lists each
        node's ``worker_ids``)."""
        here = "" if self._here is None else self._here.node_id
        return [here if node is None else node.node_id for node, _ in self._where]

    def nodes(self) -> tuple[NodeStats, ...]:
        """Per node, in the order of the rows they hold (the pool's own node among them, where
        it runs workers): layout (its workers and envs) and traffic."""
        assignment = self._options.assignment
        stats = [] if self._here is None else [self._here.stats()]
        stats += [node.stats(assignment) for node in self._nodes]
        return tuple(sorted(stats, key=lambda n: n.worker_ids[0] if n.worker_ids else -1))

    def forked(self) -> None:
        """In a forked child: the agents, the actors and the Ray are the parent's."""
        self._closed = True
        if self._here is not None:
            self._here.forked()  # forgets the Ray connection too
        else:
            forked()

    def __repr__(self) -> str:
        """The nodes in the order of the rows they hold: id, envs, workers, which envs."""
        parts = [
            f"{n.node[:8]}: {n.envs} envs/{n.workers} workers ({env_range(n.env_ids)})"
            for n in self.nodes()
        ]
        return f"NodeTransport({'; '.join(parts)})"

    # -- commands out --------------------------------------------------------------------------

    def prepare(self, worker: int, command: Command) -> None:
        """Pickle ``command`` now: what cannot travel fails before anything changes."""
        node, local = self._where[worker]
        if node is None and self._here is not None:
            self._here.prepare(local, command)
        else:
            pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)

    def submit(self, worker: int, command: Command) -> None:
        self.submit_many([(worker, command)])

    def land(self, worker: int, command: Sample, into: Sampled) -> None:
        """A rollout's part read into ``into`` (:class:`~envfleet.backends.LandsParts`): that
        of a worker on another node (the pool's own node's come in arrays of their own)."""
        node, _ = self._where[worker]
        if node is not None:
            node.landing[command] = into

    def submit_all(self, commands: Sequence[Command]) -> None:
        """A command for every worker: one message per node."""
        if self._here is not None:
            for local, worker in enumerate(self._here.workers):
                self._here.submit(local, commands[worker])
        for node in self._nodes:
            self._send_round(node, range(len(node.workers)), [commands[w] for w in node.workers])

    def submit_many(self, commands: Sequence[tuple[int, Command]]) -> None:
        """Commands for some workers (a reset, a call, an async step): one message per node."""
        rounds: dict[int, tuple[NodeLink, list[int], list[Command]]] = {}
        for worker, command in commands:
            node, local = self._where[worker]
            if node is None:
                assert self._here is not None
                self._here.submit(local, command)
                continue
            _, locals_, sent = rounds.setdefault(node.index, (node, [], []))
            locals_.append(local)
            sent.append(command)
        for node, locals_, sent in rounds.values():
            self._send_round(node, locals_, sent)

    def _send_round(self, node: NodeLink, locals_: Sequence[int], commands: list[Command]) -> None:
        """One round to ``node``, without blocking past ``self._send_timeout`` with no byte
        taken (then the node is lost); what the agent sends meanwhile is read (its rows go into
        the batch, its replies wait for ``wait``: it may be blocked writing them to us)."""
        parts = node.round(locals_, commands, self._actions)
        if parts is None:
            return  # reported lost on the next wait
        frames = node.frames
        assert node.conn is not None and frames is not None

        def take_in() -> None:
            while frames.ready():
                self._take(node, frames.read(), self._queued)

        try:
            send(node.conn.fileno(), parts, self._send_timeout, node.sock(), take_in)
        except SendTimeout:
            took = f"took no byte of a command of {sum(map(len, parts))} bytes"
            why = f"{took} for {self._send_timeout:g}s (stopped, or its node unreachable)"
            self._lose(node, f"killed: it {why}")
        except (EOFError, OSError):
            self._lose(node, "its connection broke")

    # -- replies in ----------------------------------------------------------------------------

    def wait(self, timeout: float | None, want: int = 1) -> Replies:
        replies, self._queued = self._queued, []
        for node in self._nodes:
            if not node.alive and not node.lost:
                replies += node.lost_replies()
        if replies:
            return replies
        deadline = None if timeout is None else time.monotonic() + timeout
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        here = self._here
        while True:
            # A command to the pool's own node may be answered with no socket event (a Ray
            # call): look every millisecond then.
            busy = here is not None and here.busy()
            events = self._poller.poll(min(ms, 1) if busy and ms is not None else 1 if busy else ms)
            local = busy
            for fd, _ in events:
                ready = self._by_fd.get(fd)
                if ready is not None:
                    if ready.alive:
                        self._read(ready, replies)
                elif here is not None and here.owns(fd):
                    local = True
            if local:
                assert here is not None
                replies += here.wait()
            for node in self._nodes:
                if node.killing and node.alive and (why := node.overdue_kill(replies)):
                    self._lose(node, why)  # it did not stop a hung worker in time
                if not node.alive and not node.lost:
                    replies += node.lost_replies()
            if len(replies) >= want or timeout == 0:
                return replies
            if any(isinstance(r, WorkerLost) or (r is not None and r.failures) for _, r in replies):
                return replies
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return replies
                ms = int(left * 1000 + 0.999)

    def _read(self, node: NodeLink, replies: Replies) -> None:
        """Take ``node``'s messages: the one its socket has begun, and any read with it."""
        frames = node.frames
        assert frames is not None
        while True:
            try:  # a rollout's arrays follow its answer: read by take
                self._take(node, frames.read(), replies)
            except (EOFError, OSError):
                self._lose(node, "its connection closed (the agent or its node died)")
                return
            if not frames.whole():
                return

    def _take(self, node: NodeLink, data: Message, replies: Replies) -> None:
        """Deliver the rows of one message from ``node`` and add its replies."""
        replies += node.take(
            data, self._rows, self.batch, self._space, self._restarts, self._codecs
        )

    def _lose(self, node: NodeLink, why: str) -> None:
        """The node's agent is gone: each of its workers is reported lost on the next wait."""
        if not node.alive:
            return
        if node.conn is not None:  # no longer waited on
            fd = node.conn.fileno()
            self._by_fd.pop(fd, None)
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(fd)
        node.lose(why)

    # -- killing and restarting ----------------------------------------------------------------

    def kill(self, worker: int) -> None:
        """Have ``worker``'s agent kill it (it hangs); should the agent not report it lost
        within its grace (:data:`~envfleet.backends.nodes.link.KILL_GRACE`: the agent hangs
        too), the agent is killed: its whole node is lost."""
        node, local = self._where[worker]
        if node is None:
            assert self._here is not None
            self._here.kill(local)
            return
        if not node.alive:
            return
        try:
            node.ask_kill(local)
        except OSError:
            self._lose(node, "its connection broke")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        node, local = self._where[worker]
        if node is None:
            assert self._here is not None
            self._here.restart(local, restarts)
            return
        for i, count in restarts.items():
            self._restarts[i] = count
        if not node.alive:  # a new agent for the whole node
            self._actors.rebuild(node, worker, restarts, self._restarts, self._rows)
        rebuilt = node.rebuilt.pop(local, None)
        if rebuilt is not None and rebuilt == restarts:
            return
        try:
            node.ask_restart(local, restarts)
            error = self._ack(node)
        except (EOFError, OSError):
            # The agent went while it replaced its worker (its node was removed: the worker
            # died first): its other workers are lost too, and a new agent builds the node.
            self._lose(node, "its connection broke during a restart")
            self._queued += node.lost_replies(but=local)
            self.restart(worker, restarts)
            return
        node.memory[local] = None  # the old process's figure
        if error is not None:
            raise wire.rebuild(error, node.workers, self._options.spec.name)

    def _ack(self, node: NodeLink) -> Any:
        """Read ``node``'s messages up to its acknowledgement (the others wait for ``wait``)."""
        while True:
            assert node.conn is not None and node.frames is not None
            if not node.frames.whole() and not node.conn.poll(self._options.start_timeout):
                self._lose(node, "did not answer a restart within start_timeout")
                raise node.start_failed(
                    self._options.assignment, "did not answer a restart", EnvTimeoutError
                )
            data = node.frames.read()
            if data[:1] == wire.ACK:
                body, _ = wire.read_header(data)
                while node.frames.whole():  # read with it: no socket event will tell of it
                    self._take(node, node.frames.read(), self._queued)
                return body
            self._take(node, data, self._queued)  # another worker's reply came first

    # -- closing -------------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        here: list[Any] = []  # the agents' processes on this machine, and their children
        try:
            deadline = time.monotonic() + timeout
            here = local_agents(self._nodes)
            ask_to_close(self._nodes, deadline)
            if self._here is not None:
                self._here.close(max(0.0, deadline - time.monotonic()))
        finally:
            end_agents(self._nodes, here, timeout)
            if self._here is not None:
                self._here.close(0.0)  # idempotent; after a failure above
            if self._connected:
                self._connected = False
                disconnect()


def open_transport(options: TransportOptions) -> NodeTransport:
    return NodeTransport(options)
