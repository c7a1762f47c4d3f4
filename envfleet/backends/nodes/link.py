"""One node's agent as the pool sees it: its connection, what it owes, and the rounds each way.

:class:`NodeLink` turns a round of commands for the node's workers into one message
(:meth:`NodeLink.round`) and one message from the agent into the replies it carries, writing
the node's rows into the pool's batch on the way (:meth:`NodeLink.take`); the messages are
:mod:`envfleet.backends.nodes.wire`'s; it asks the agent to kill a hung worker and says when
the agent is past its grace (:meth:`NodeLink.ask_kill`, :meth:`NodeLink.overdue_kill`).
:class:`~envfleet.backends.nodes.transport.NodeTransport` holds one link per node and does the
waiting and the restarting; the agents' lives as Ray actors are
:mod:`~envfleet.backends.nodes.actors`'.
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
import ray

from envfleet.backends.contract import raw_parts
from envfleet.backends.contract.base import Replies, WorkerLost
from envfleet.backends.contract.rows import deliver
from envfleet.backends.nodes import raw_rows, wire
from envfleet.backends.nodes.frames import Frames, Message
from envfleet.buffers import Batch
from envfleet.errors import Phase, WorkerDiedError
from envfleet.protocol import Command, Reply, Sample
from envfleet.rollout_loop import Sampled
from envfleet.stats import NodeStats

KILL_GRACE = 2.0
"""Seconds an agent has to report lost a worker the pool asked it to kill before the pool kills
the agent itself (stopped, or its node gone); :data:`SILENT_GRACE` once it has said nothing for
:data:`SILENT` seconds: a live agent answers its other workers within ``HOLD_LIMIT`` (50 ms) of
a round, so it is stopped, or every worker of its node hangs (its envs are lost either way)."""

SILENT, SILENT_GRACE = 0.5, 1.0

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
    # The restarts, affinity and rows (None: none) its agent got.
    spawned: tuple[dict[int, int], bool, list[np.ndarray] | None] = ({}, False, None)
    killing: dict[int, tuple[float, float]] = field(default_factory=dict)  # deadline, grace
    rebuilt: dict[int, dict[int, int]] = field(default_factory=dict)  # by a new agent
    # Per rollout command, the arrays the pool gave for its part (raw_parts), until answered.
    landing: dict[Sample, Sampled] = field(default_factory=dict)
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
            worker_ids=tuple(self.workers),
            env_ids=self.env_ids(assignment),
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

    def disconnect(self) -> None:
        """Close the connection to the agent (it sees EOF), if there is one."""
        if self.conn is not None:
            self.drop_sock()
            self.conn.close()
            self.conn = None
            self.frames = None

    def lose(self, why: str) -> None:
        """The agent is gone (``why``): disconnected and killed; its workers are reported lost
        by :meth:`lost_replies`."""
        self.alive = False
        self.lost = False
        self.why = why
        self.disconnect()
        self.kill_agent()

    def kill_agent(self) -> None:
        if self.agent is not None:
            try:
                ray.kill(self.agent, no_restart=True)
            except Exception:
                pass

    def measured(self, local: int) -> int | None:
        """Resident bytes of worker ``local``'s process as the agent last reported them
        (``None``: not yet, or the agent is gone); asks the agent for fresh figures when it
        answered the last ask. Raises ``OSError``: the connection broke."""
        if not self.alive:
            return None  # its figures are the gone agent's
        if not self.measuring and self.conn is not None:
            self.conn.send_bytes(wire.MEMORY)
            self.measuring = True
        return self.memory[local]

    def ask_restart(self, local: int, restarts: dict[int, int]) -> None:
        """Ask the agent to replace worker ``local`` with ``restarts``: what it had in flight
        is dropped. Raises ``OSError``: the connection broke."""
        assert self.conn is not None
        self.inflight[local].clear()
        self.last = None
        self.conn.send_bytes(wire.header(wire.RESTART, (local, restarts)))

    def ask_kill(self, local: int) -> None:
        """Ask the agent to kill its worker ``local`` (it hangs), giving it :data:`KILL_GRACE`
        to report it lost (:data:`SILENT_GRACE` when it has said nothing for :data:`SILENT`
        seconds). Raises ``OSError``: the connection broke."""
        assert self.conn is not None
        self.conn.send_bytes(wire.KILL + bytes([local >> 8, local & 0xFF]))
        silent = time.perf_counter() - self.heard_at >= SILENT
        grace = SILENT_GRACE if silent else KILL_GRACE
        self.killing.setdefault(local, (time.monotonic() + grace, grace))

    def overdue_kill(self, replies: Replies) -> str | None:
        """Forget the kills the agent reported in ``replies``; why the agent itself must be
        killed when one is past its grace (``None``: none is)."""
        reported = {w for w, r in replies if isinstance(r, WorkerLost)}
        for local in [k for k in self.killing if self.workers[k] in reported]:
            del self.killing[local]
        if self.killing and time.monotonic() > (due := min(self.killing.values()))[0]:
            return f"killed: it did not stop a hung worker within {due[1]:g}s"
        return None

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
            parts = wire.submit(list(zip(locals_, commands, strict=True)))
            self.last = commands if len(locals_) == len(self.workers) else None
            self.actions = None
        if actions:
            cached = self.actions
            if cached is None or not repeat:
                ids = raw_rows.action_ids(commands)
                sel = raw_rows.selection(ids)
                cached = self.actions = (ids, sel, raw_rows.row_views(actions, sel))
            _, sel, views = cached
            parts += views if views is not None else raw_rows.pack(actions, sel)
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
        codecs: raw_rows.Codecs = None,
    ) -> Replies:
        """The replies one message from the agent carries (the pool's worker indices); its rows
        are written into ``rows`` (the batch's arrays) first (decompressed by ``codecs``), infos
        that travel as columns into ``batch.infos``, and each env restarted is counted in
        ``restarts``. An answer to :data:`~.node_wire.MEMORY` carries none: its figures go to
        :attr:`memory`. The answer to a rollout is followed by its parts' arrays, read here
        from :attr:`frames` into those :attr:`landing` holds for their commands (else new
        ones). Raises ``EOFError``, ``OSError``: the connection broke."""
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
                ids = raw_rows.row_ids((c, None) for c in commands)
                sel = raw_rows.selection(ids)
                views = None if codecs else raw_rows.row_views(rows, sel)
                self.plain[key] = (order, commands, ids, sel, views, replies)
            if views is not None:
                raw_rows.copy_into(views, data, at)
            else:
                raw_rows.unpack(rows, sel, ids.size, data, at, codecs)
            return replies.copy()
        if tag == wire.ACK:  # pragma: no cover - only in answer to a restart or close
            return []
        (body, columns), at = wire.read_header_parts(data)
        for part in columns:
            batch.infos.put(part)
        answered: list[tuple[Command, Reply | None]] = []
        out: Replies = []
        arrays: list[np.ndarray] | None = None  # where a rollout's arrays are read (raw_parts)
        unpacks: list[raw_parts.Unpack] = []  # its compressed frames, decompressed once read
        for local, reply in body:
            if isinstance(reply, WorkerLost):  # as its agent saw it: where, too
                self.inflight[local].clear()
                where = f"on node {self.node_id} ({self.host})"
                out.append((workers[local], WorkerLost(reply.exitcode, f"{reply.reason} {where}")))
                continue
            command = self.inflight[local].popleft()
            answered.append((command, reply))
            into = self.landing.pop(command, None) if isinstance(command, Sample) else None
            for part in raw_parts.stripped(reply):
                arrays = (arrays or []) + raw_parts.destinations(part, into, unpacks=unpacks)
            if reply is not None:
                for failure in reply.restarts:
                    if failure.env_index is not None:
                        restarts[failure.env_index] += 1
                if reply.rows is not None:  # pickled observations
                    deliver(batch, space, reply)
            out.append((workers[local], reply))
        ids = raw_rows.row_ids(answered)
        raw_rows.unpack(rows, raw_rows.selection(ids), ids.size, data, at, codecs)
        if arrays is not None:  # the frame that follows: read straight into them
            assert self.frames is not None
            self.frames.read_into(arrays)
            self.bytes_in += sum(array.nbytes for array in arrays)
            raw_parts.unpack(unpacks, raw_rows.frames_codec(codecs))
        return out


__all__ = ["KILL_GRACE", "SILENT", "SILENT_GRACE", "NodeLink"]
