"""The Ray backend across nodes: one sub-pool per node, one message per node per command.

::

    pool (driver)                 node A: NodeAgent (Ray actor)        node B: NodeAgent ...
    ─────────────                 ─────────────────────────────
    submit_all(step) ── 1 msg ──► local ProcessTransport ─ pipes ─► worker processes
      (actions of A's envs)        (shared memory of node A)          (EnvGroup, global ids)
    wait: poll the nodes' ◄── 1 msg (rows of all of A's envs) ──
      sockets; rows land with one slice assignment per field

Ray places one :class:`~envfleet.backends.nodes.agent.NodeAgent` on each chosen node (pinned
with ``NodeAffinitySchedulingStrategy``), watches it and kills it; the data itself goes over a
TCP connection between the pool and each agent (listening on the node's Ray address, opened
with a per-pool secret handed to the agent through Ray, ``multiprocessing``'s challenge: a
stranger without it is dropped). The pool's workers are laid over the nodes in contiguous runs,
so a node's envs are consecutive rows: its rows arrive as the raw bytes of each field and are
written with ``np.frombuffer`` and one slice assignment, with no Python per env.

Which nodes, and how many workers on each, is :mod:`~envfleet.backends.nodes.placement`'s; each
node's agent, as the pool sees it (its connection, what it owes, a round in one message each
way), is a :class:`~envfleet.backends.nodes.link.NodeLink`; this transport waits on them all,
kills and restarts.

A node whose agent dies (or is killed: it did not stop a hung worker when asked) loses all its
workers: each is reported lost (:class:`~envfleet.backends.contract.base.WorkerLost` naming
the node).
Under ``on_error="restart"`` the first restart asks for a new agent, on the same node when Ray
still has it, else wherever Ray finds room, which builds all that node's envs restarted.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import secrets
import select
import time
from collections.abc import Sequence
from multiprocessing import AuthenticationError
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envfleet.backends.contract.base import BaseTransport, Replies, TransportOptions, WorkerLost
from envfleet.backends.nodes import compression, wire
from envfleet.backends.nodes.agent import NodeAgent, node_options, remove_dead_agents_dirs
from envfleet.backends.nodes.driver_node import DriverNode, shared_node
from envfleet.backends.nodes.frames import SEND_TIMEOUT, Frames, Message, SendTimeout, send
from envfleet.backends.nodes.link import NodeLink, bury, connect_agent, local_agents
from envfleet.backends.nodes.placement import choose_nodes, place
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.session import START_ATTEMPTS, await_start, connect, disconnect, forked
from envfleet.buffers import Batch, ObjectRows
from envfleet.errors import EnvTimeoutError
from envfleet.protocol import Command
from envfleet.stats import NodeStats, env_range

KILL_GRACE = 2.0
"""Seconds an agent has to report lost a worker the pool asked it to kill before the pool kills
the agent itself (stopped, or its node gone); :data:`SILENT_GRACE` once it has said nothing for
:data:`SILENT` seconds: a live agent answers its other workers within ``HOLD_LIMIT`` (50 ms) of
a round, so it is stopped, or every worker of its node hangs (its envs are lost either way)."""

SILENT, SILENT_GRACE = 0.5, 1.0


class NodeTransport(BaseTransport):
    """One agent per node; each node's commands and replies travel as one message."""

    def __init__(self, options: TransportOptions) -> None:
        extra = options.backend_options
        if not isinstance(extra, RayOptions):
            extra = RayOptions()
        self._options = options
        self._closed = False
        # A node's command goes as the agent takes it: past this long without it taking a
        # byte, the agent is stopped or unreachable, and its node is lost.
        self._send_timeout = (
            options.step_timeout if options.step_timeout is not None else SEND_TIMEOUT
        )
        codec = compression.codec(extra.compress)
        probe = Batch.local(options.observation_space, options.action_space, 1)
        if extra.compress is not None and wire.row_codecs(wire.row_fields(probe), codec) is None:
            raise ValueError(
                f"compress={extra.compress!r} compresses image observations (uint8 arrays of "
                f"two or more dimensions a row); {options.observation_space} has none"
            )
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
            where: dict[int, tuple[NodeLink | None, int]] = {}
            here, here_workers = shared_node(extra), []
            for (node_id, _), workers in zip(chosen, runs, strict=True):
                if node_id == here:
                    here_workers = workers
                    where.update((w, (None, k)) for k, w in enumerate(workers))
                elif workers:
                    node = NodeLink(len(self._nodes), node_id, workers)
                    self._nodes.append(node)
                    where.update((w, (node, k)) for k, w in enumerate(workers))
            self._where = [where[w] for w in range(len(options.assignment))]
            self._agent_cls = ray.remote(NodeAgent)
            self._resources = {k: v for k, v in extra.worker_resources.items()}
            self._resources.setdefault("num_cpus", 0)
            for node in self._nodes:
                self._spawn(node, {}, soft=False)
            if here_workers:  # its actors start while the agents do
                assert here is not None
                self._here = DriverNode(options, here_workers, here, extra, self._poller)
                self._here.host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
            self.batch = (
                self._here.batch
                if self._here is not None
                else Batch.local(options.observation_space, options.action_space, options.num_envs)
            )
            self._rows = wire.row_fields(self.batch)
            self._codecs = wire.row_codecs(self._rows, codec)
            self._actions = (
                wire.leaves(self.batch.actions)
                if not isinstance(self.batch.actions, ObjectRows)
                else []
            )
            self._await(self._nodes)
        except BaseException:
            self.close(1.0)
            raise

    # -- starting agents -----------------------------------------------------------------------

    def _spawn(self, node: NodeLink, restarts: dict[int, int], soft: bool) -> None:
        node.spawned = (restarts, soft)
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=soft)
        node.agent = self._agent_cls.options(
            max_concurrency=1, max_restarts=0, scheduling_strategy=strategy, **self._resources
        ).remote(node_options(self._options, node.workers), restarts)
        node.started()

    def _respawn(self, node: NodeLink) -> Any:
        """Another agent for ``node`` (the last one died starting, placed on a node that just
        died): wherever Ray finds room; its start call's ref."""
        restarts, _ = node.spawned
        self._spawn(node, restarts, soft=True)
        return node.agent.start.remote(self._authkey)

    def _await(self, nodes: Sequence[NodeLink]) -> None:
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
        if not node.alive:
            return None  # its figures are the gone agent's
        if not node.measuring and node.conn is not None:
            try:
                node.conn.send_bytes(wire.MEMORY)
            except OSError:
                self._lose(node, "its connection broke")
                return None
            node.measuring = True
        return node.memory[local]

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
        stats += [
            dataclasses.replace(
                node.stats(assignment),
                worker_ids=tuple(node.workers),
                env_ids=node.env_ids(assignment),
            )
            for node in self._nodes
        ]
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
            size = sum(map(len, parts))
            self._lose(
                node,
                f"killed: it took no byte of a command of {size} bytes for "
                f"{self._send_timeout:g}s (stopped, or its node unreachable)",
            )
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
                if node.killing and node.alive:
                    self._check_kills(node, replies)
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
            try:
                data = frames.read()
            except (EOFError, OSError):
                self._lose(node, "its connection closed (the agent or its node died)")
                return
            self._take(node, data, replies)
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
        node.alive = False
        node.lost = False
        node.why = why
        if node.conn is not None:
            fd = node.conn.fileno()
            try:
                self._poller.unregister(fd)
            except (KeyError, ValueError):
                pass
            self._by_fd.pop(fd, None)
            node.drop_sock()
            node.conn.close()
            node.conn = None
            node.frames = None
        node.kill_agent()

    # -- killing and restarting ----------------------------------------------------------------

    def kill(self, worker: int) -> None:
        """Have ``worker``'s agent kill it (it hangs); should the agent not report it lost
        within :data:`KILL_GRACE` (the agent hangs too), the agent is killed: its whole node is
        lost."""
        node, local = self._where[worker]
        if node is None:
            assert self._here is not None
            self._here.kill(local)
            return
        if not node.alive:
            return
        try:
            assert node.conn is not None
            node.conn.send_bytes(wire.KILL + bytes([local >> 8, local & 0xFF]))
        except OSError:
            self._lose(node, "its connection broke")
            return
        silent = time.perf_counter() - node.heard_at >= SILENT
        grace = SILENT_GRACE if silent else KILL_GRACE
        node.killing.setdefault(local, (time.monotonic() + grace, grace))

    def _check_kills(self, node: NodeLink, replies: Replies) -> None:
        """Forget the kills the agent reported; kill the agent past the grace of one."""
        reported = {w for w, r in replies if isinstance(r, WorkerLost)}
        for local in [k for k in node.killing if node.workers[k] in reported]:
            del node.killing[local]
        if node.killing and time.monotonic() > (due := min(node.killing.values()))[0]:
            self._lose(node, f"killed: it did not stop a hung worker within {due[1]:g}s")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        node, local = self._where[worker]
        if node is None:
            assert self._here is not None
            self._here.restart(local, restarts)
            return
        for i, count in restarts.items():
            self._restarts[i] = count
        if not node.alive:
            # A new agent for the whole node: its other workers were reported lost too and will
            # be restarted with one more restart each, as the pool's recovery counts them.
            assignment = self._options.assignment
            counts = {
                i: int(self._restarts[i]) + (0 if w == worker else 1)
                for w in node.workers
                for i in assignment[w]
            }
            counts.update(restarts)
            node.rebuilt = {
                k: {i: counts[i] for i in assignment[w]} for k, w in enumerate(node.workers)
            }
            self._spawn(node, counts, soft=True)
            self._await([node])
        rebuilt = node.rebuilt.pop(local, None)
        if rebuilt is not None and rebuilt == restarts:
            return
        assert node.conn is not None
        node.inflight[local].clear()
        node.last = None
        try:
            node.conn.send_bytes(wire.header(wire.RESTART, (local, restarts)))
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
            for node in self._nodes:
                if node.alive and node.conn is not None:
                    try:
                        node.conn.send_bytes(wire.CLOSE)
                    except OSError:
                        pass
            serving = [n.serving for n in self._nodes if n.alive and n.serving is not None]
            if serving and ray.is_initialized():
                try:
                    ray.wait(
                        serving,
                        num_returns=len(serving),
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                except Exception:
                    pass
            if self._here is not None:
                self._here.close(max(0.0, deadline - time.monotonic()))
        finally:
            for node in self._nodes:
                if node.conn is not None:
                    node.drop_sock()
                    node.conn.close()
                    node.conn = None
                    node.frames = None
                node.alive = False
                if ray.is_initialized():
                    node.kill_agent()
            # ray.kill returns at once: the agents here (their workers too) end within
            # ``timeout`` more, or are ended; then what they left in the temp dir goes.
            bury(here, timeout)
            remove_dead_agents_dirs()
            if self._here is not None:
                self._here.close(0.0)  # idempotent; after a failure above
            if self._connected:
                self._connected = False
                disconnect()


def open_transport(options: TransportOptions) -> NodeTransport:
    return NodeTransport(options)


__all__ = ["KILL_GRACE", "NodeTransport", "open_transport"]
