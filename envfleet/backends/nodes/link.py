"""One node's agent as the pool sees it: its connection, what it owes, and the rounds each way.

:class:`NodeLink` turns a round of commands for the node's workers into one message
(:meth:`NodeLink.round`) and one message from the agent into the replies it carries, writing
the node's rows into the pool's batch on the way (:meth:`NodeLink.take`); the messages are
:mod:`envfleet.backends.nodes.wire`'s. :class:`~envfleet.backends.nodes.transport.NodeTransport`
holds one link per node and does the waiting, the killing and the restarting.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from operator import is_
from typing import Any

import gymnasium
import numpy as np
import psutil
import ray

from envfleet.backends.contract.base import Replies, WorkerLost
from envfleet.backends.contract.connections import handshake
from envfleet.backends.contract.rows import deliver
from envfleet.backends.nodes import wire
from envfleet.backends.nodes.frames import Frames, Message
from envfleet.buffers import Batch
from envfleet.errors import Phase, WorkerDiedError
from envfleet.protocol import Command, Reply
from envfleet.stats import NodeStats

CONNECT_TIMEOUT = 30.0
"""Seconds the pool gives an agent's socket to accept it and prove the key (the connection and
the whole handshake)."""

_Plain = tuple[
    list[int], list[Command], np.ndarray, "slice | np.ndarray", "list[memoryview] | None", Replies
]
"""A plain answer's workers (the agent's), the commands it answered, their envs, those envs'
rows, the rows' views (``None``: unpacked with numpy), and its replies (the pool's workers)."""


@dataclass
class NodeLink:
    """One node's agent and what the pool owes it and is owed by it."""

    index: int
    node_id: str
    workers: list[int]  # global worker indices, in order (the agent's 0, 1, ...)
    agent: Any = None
    conn: Connection | None = None
    frames: Frames | None = None  # the agent's messages in (``conn``'s descriptor)
    serving: Any = None
    host: str = ""
    pid: int = 0
    alive: bool = False
    lost: bool = False  # reported lost; waits for a restart
    inflight: list[deque[Command]] = field(default_factory=list)
    last: list[Command] | None = None  # the round the agent would repeat
    # The envs whose actions the last round carried, their rows, and those rows' views.
    actions: tuple[np.ndarray, slice | np.ndarray, list[memoryview] | None] | None = None
    plain: dict[bytes, _Plain] = field(
        default_factory=dict
    )  # the rows of a plain answer, by the commands it answers (the same objects each step)
    why: str = ""  # why it was lost
    spawned: tuple[dict[int, int], bool] = ({}, False)  # the restarts and affinity it got
    killing: dict[int, tuple[float, float]] = field(default_factory=dict)  # deadline, grace
    rebuilt: dict[int, dict[int, int]] = field(default_factory=dict)  # by a new agent
    messages: int = 0  # sent to it
    answers: int = 0  # received from it
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0  # message out to its answer in, summed
    sent_at: float = 0.0
    heard_at: float = 0.0  # its last message in (``time.perf_counter``)
    memory: list[int | None] = field(default_factory=list)  # per local worker, as last reported
    measuring: bool = False  # asked for its workers' memory, not answered yet
    # ``conn``'s socket on a descriptor of its own, for the sends that must not block.
    outlet: socket.socket | None = None
    outlet_of: Connection | None = None  # the connection ``outlet`` duplicates

    def env_ids(self, assignment: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The node's envs (global indices)."""
        return tuple(i for w in self.workers for i in assignment[w])

    def stats(self, assignment: Sequence[Sequence[int]]) -> NodeStats:
        """The node's layout and traffic, for ``pool.stats().nodes``."""
        return NodeStats(
            node=self.node_id,
            address=self.host,
            workers=len(self.workers),
            envs=len(self.env_ids(assignment)),
            messages=self.messages,
            answers=self.answers,
            bytes_out=self.bytes_out,
            bytes_in=self.bytes_in,
            round_trip_ms=self.seconds / self.messages * 1e3 if self.messages else None,
        )

    def start_failed(
        self,
        assignment: Sequence[Sequence[int]],
        why: str,
        kind: type[WorkerDiedError] = WorkerDiedError,
    ) -> WorkerDiedError:
        """The error of an agent that could not start its workers, naming the node and envs."""
        ids = self.env_ids(assignment)
        return kind(
            f"the agent of node {self.node_id} (workers {self.workers}, envs {list(ids)}) {why}",
            env_index=None,
            phase=Phase.MAKE,
            worker=self.workers[0],
            env_ids=ids,
        )

    def lost_replies(self, but: int | None = None) -> Replies:
        """The agent is gone: each of its workers (but the local worker ``but``) lost."""
        self.lost = True
        reason = f"the agent of node {self.node_id} ({self.host}) is gone: {self.why}"
        out: Replies = []
        for k, worker in enumerate(self.workers):
            self.inflight[k].clear()
            if k != but:
                out.append((worker, WorkerLost(None, reason)))
        return out

    def sock(self) -> socket.socket:
        """The connection to the agent as a socket (its own descriptor: closed by
        :meth:`drop_sock`, or when collected, never the connection's)."""
        conn = self.conn
        assert conn is not None
        if self.outlet is None or self.outlet_of is not conn:
            self.drop_sock()
            fd = os.dup(conn.fileno())
            try:
                self.outlet = socket.socket(fileno=fd)
            except BaseException:
                os.close(fd)
                raise
            self.outlet_of = conn
        return self.outlet

    def drop_sock(self) -> None:
        """Close :meth:`sock`'s descriptor (with the connection's: the agent sees EOF)."""
        if self.outlet is not None:
            self.outlet.close()
        self.outlet = self.outlet_of = None

    def kill_agent(self) -> None:
        if self.agent is not None:
            try:
                ray.kill(self.agent, no_restart=True)
            except Exception:
                pass

    def started(self) -> None:
        """A new agent: nothing in flight, nothing to repeat."""
        self.inflight = [deque() for _ in self.workers]
        self.last = None
        self.actions = None
        self.killing = {}
        self.memory = [None] * len(self.workers)
        self.measuring = False

    # -- out -----------------------------------------------------------------------------------

    def round(
        self, locals_: Sequence[int], commands: list[Command], actions: Sequence[np.ndarray]
    ) -> list[bytes | memoryview] | None:
        """Book ``commands`` (one per local worker of ``locals_``) in flight and return the
        parts of the one message that carries them, with the rows of ``actions`` they need (as
        views of ``actions`` when their rows repeat: written by one ``writev``, not joined);
        ``None`` when the agent is gone (its workers are reported lost on the next wait)."""
        for local, command in zip(locals_, commands, strict=True):
            self.inflight[local].append(command)
        if not self.alive:
            return None
        last = self.last
        repeat = last is not None and len(last) == len(commands) and all(map(is_, last, commands))
        parts: list[bytes | memoryview]
        if repeat:
            parts = [wire.REPEAT]
        else:
            parts = [wire.header(wire.SUBMIT, list(zip(locals_, commands, strict=True)))]
            self.last = commands if len(locals_) == len(self.workers) else None
            self.actions = None
        if actions:
            cached = self.actions
            if cached is None or not repeat:
                ids = wire.action_ids(commands)
                sel = wire.selection(ids)
                cached = self.actions = (ids, sel, wire.row_views(actions, sel))
            _, sel, views = cached
            parts += views if views is not None else wire.pack(actions, sel)
        self.messages += 1
        self.bytes_out += sum(map(len, parts))  # bytes: views of the actions' rows cast to B
        self.sent_at = time.perf_counter()
        return parts

    # -- in ------------------------------------------------------------------------------------

    def take(
        self,
        data: Message,
        rows: Sequence[np.ndarray],
        batch: Batch,
        space: gymnasium.Space[Any],
        restarts: np.ndarray,
        codecs: wire.Codecs = None,
    ) -> Replies:
        """The replies one message from the agent carries (the pool's worker indices); its rows
        are written into ``rows`` (the batch's arrays) first (decompressed by ``codecs``), infos
        that travel as columns into ``batch.infos``, and each env restarted is counted in
        ``restarts``. An answer to :data:`~.node_wire.MEMORY` carries none: its figures go to
        :attr:`memory`."""
        self.heard_at = now = time.perf_counter()
        if data[:1] == wire.MEMORY:
            self.memory, self.measuring = wire.read_memory(data), False
            return []
        self.answers += 1
        self.bytes_in += len(data)
        self.seconds += now - self.sent_at
        tag = data[:1]
        workers = self.workers
        if tag == wire.PLAIN or tag == wire.INFOS:
            key, at = wire.read_plain_workers(data)
            if tag == wire.INFOS:  # infos of plain scalars: into the table, as they came
                columns, at = wire.read_pickled(data, at)
                for part in columns:
                    batch.infos.put(part)
            cached = self.plain.get(key)
            if cached is None:
                if len(self.plain) > 64:
                    self.plain.clear()
                order = np.frombuffer(key, np.uint16, offset=2).tolist()
                replies: Replies = [(workers[k], None) for k in order]
                cached = (order, [], np.empty(0, np.intp), slice(0, 0), None, replies)
                self.plain[key] = cached
            order, known, ids, sel, views, replies = cached
            inflight = self.inflight
            commands = [inflight[k].popleft() for k in order]
            if len(known) != len(commands) or not all(map(is_, known, commands)):
                ids = wire.row_ids((c, None) for c in commands)
                sel = wire.selection(ids)
                views = None if codecs else wire.row_views(rows, sel)
                self.plain[key] = (order, commands, ids, sel, views, replies)
            if views is not None:
                wire.copy_into(views, data, at)
            else:
                wire.unpack(rows, sel, ids.size, data, at, codecs)
            return replies.copy()
        if tag == wire.ACK:  # pragma: no cover - only in answer to a restart or close
            return []
        (body, columns), at = wire.read_header_parts(data)
        for part in columns:
            batch.infos.put(part)
        answered: list[tuple[Command, Reply | None]] = []
        out: Replies = []
        for local, reply in body:
            if isinstance(reply, WorkerLost):  # as its agent saw it: where, too
                self.inflight[local].clear()
                where = f"on node {self.node_id} ({self.host})"
                out.append((workers[local], WorkerLost(reply.exitcode, f"{reply.reason} {where}")))
                continue
            command = self.inflight[local].popleft()
            answered.append((command, reply))
            if reply is not None:
                for failure in reply.restarts:
                    if failure.env_index is not None:
                        restarts[failure.env_index] += 1
                if reply.rows is not None:  # pickled observations
                    deliver(batch, space, reply)
            out.append((workers[local], reply))
        ids = wire.row_ids(answered)
        wire.unpack(rows, wire.selection(ids), ids.size, data, at, codecs)
        return out


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


def bury(processes: list[psutil.Process], timeout: float) -> None:
    """Wait up to ``timeout`` for ``processes`` to end, then end those still there (and wait
    for them as long again)."""
    try:
        _, alive = psutil.wait_procs(processes, timeout=timeout)
        for process in alive:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=timeout)
    except psutil.Error:
        pass


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


__all__ = ["CONNECT_TIMEOUT", "NodeLink", "bury", "connect_agent", "local_agents"]
