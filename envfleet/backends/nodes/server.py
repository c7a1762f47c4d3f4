"""A node agent's loop: the pool's rounds in, the node's replies and rows out.

::

    pool ── a round (S or R + action rows) ──► actions into the node's batch; each command to
                                               its local worker (the process backend's pipes)
                                               wait on the workers and the pool together
    pool ◄── one answer (P, I or G + rows) ─── a round all in (or a failure, a lost worker,
                                               or its replies held past their limit)

Infos that workers send as columns (plain scalars: Atari's, MuJoCo's) reach the agent as bytes,
never as dicts, and go on to the pool as they came (an ``I`` answer when the replies have
nothing else to say). The answer to a rollout is followed by its parts' recorded arrays, a frame
of their own that the pool reads into the rollout's columns
(:mod:`~envfleet.backends.contract.raw_parts`); its workers record them in blocks of the agent's
shared memory (:mod:`envfleet.shared_records`), which the frame is written from.

Each message from the pool is a round, and each round is answered as soon as all of its
replies are in, whatever else the node owes: with two halves of the node's envs in flight
(async, ``batch_size < num_envs``, one round each), the first half's rows go while the other
half steps, so the pool sends that half's next actions before the node's cores run out of
work. A sync step is one round of every worker, answered in one message. The messages are
:mod:`envfleet.backends.nodes.wire`'s; the agent that runs this loop is
:class:`~envfleet.backends.nodes.agent.NodeAgent`.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from multiprocessing.connection import Connection
from operator import is_, itemgetter
from typing import Any

import gymnasium
import numpy as np

from envfleet.backends.contract import raw_parts
from envfleet.backends.contract.base import LandsParts, LocalPool, WorkerLost
from envfleet.backends.nodes import raw_rows, wire
from envfleet.backends.nodes.compression import Codec
from envfleet.backends.nodes.frames import Frames, Message, send
from envfleet.buffers import ObjectRows
from envfleet.errors import EnvError
from envfleet.info_columns import Columns
from envfleet.protocol import Command, Reply, Rows, Sample
from envfleet.recycling import Recycler
from envfleet.rollout_loop import Sampled, placed, record_arrays

LOCAL_SLICE = 0.002
"""Seconds at most the agent holds the replies of a round that is not all in (async): past
it, what is in goes."""

WAIT_SLICE = 1.0
"""Seconds at most the agent waits at a time on its workers and the pool's connection
together (either wakes it at once: a reply, or the pool's next round, a kill, a close)."""

HOLD_LIMIT = 0.05
"""Seconds at most the agent holds the replies of a sync step's fast workers while a slow one
finishes, to send the node's answer as one message: past it, what is in goes, so that the
pool's ``step_timeout`` sees a hung worker's fast neighbours answer (a ``step_timeout`` this
short would blame them)."""

_Held = tuple[int, "Command | None", "Reply | WorkerLost | None"]
"""A reply in, not yet sent: local worker, the command it answers (``None``: lost), reply."""

_Plain = tuple[list[Command], bytes, "slice | np.ndarray", "list[memoryview] | None"]
"""A plain answer's commands, its workers part, its rows, and their views (``None``: packed)."""

_Recording = tuple[LandsParts, gymnasium.Space[Any], gymnasium.Space[Any]]
"""Where the workers record their rollouts' parts: the local pool that lands them, and the
observation and action spaces."""

_by_worker = itemgetter(0)


class NodeServer:
    """The agent's loop over its node's workers (``local``) and the pool's connection."""

    def __init__(
        self,
        local: LocalPool,
        conn: Connection,
        workers: int,
        codec: Codec | None,
        columns: list[Columns] | None = None,
        spaces: tuple[gymnasium.Space[Any], gymnasium.Space[Any]] | None = None,
    ) -> None:
        self.local = local
        # Where each worker records its part of a rollout: a block of this agent's shared
        # memory (:mod:`envfleet.shared_records`), sent from there; by the Sample, till answered.
        self.recording: _Recording | None = None
        if isinstance(local, LandsParts) and spaces is not None:
            self.recording = (local, *spaces)
        self.memory = Recycler(shared=True)
        self.records: dict[Command, Sampled] = {}
        # The infos the workers sent as columns since the last answer (``local`` appends them
        # as it reads the replies they belong to: those replies are held, and go with them).
        self.columns: list[Columns] = [] if columns is None else columns
        self.conn = conn
        self.frames = Frames(conn.fileno())  # the pool's messages, read in one go each
        local.watch(conn.fileno())  # its wait ends when the pool speaks
        batch = local.batch
        self.batch = batch
        self.rows = raw_rows.row_fields(batch)
        self.codecs = raw_rows.row_codecs(self.rows, codec)
        self.codec = raw_rows.frames_codec(self.codecs)  # a rollout's frames, per step
        self.objects = isinstance(batch.observations, ObjectRows)
        self.actions = raw_rows.action_fields(batch)
        # Per local worker, its commands not answered yet, each with its round's number.
        self.inflight: list[deque[tuple[Command, int]]] = [deque() for _ in range(workers)]
        self.left: dict[int, int] = {}  # per round in flight: its replies not in yet
        self.rounds = 0
        self.owed = 0
        self.last: list[tuple[int, Command]] = []
        # The envs whose actions the last round carried, their rows, and those rows' views.
        self.last_actions: tuple[np.ndarray, slice | np.ndarray, list[memoryview] | None] | None
        self.last_actions = None
        self.workers = workers
        self.memory.keep_at_least(workers + 2)  # a free block each between its parts
        self.hold = False  # a sync step's round: held up to HOLD_LIMIT, not LOCAL_SLICE
        # The last round's commands in the workers' order, when it named every worker in it.
        self.in_order: list[Command] | None = None
        self.held: list[_Held] = []
        self.held_since = 0.0
        self.complete = False  # a round is all in since the last answer
        self.bad = False  # a failure or a lost worker is held: it goes at once
        # A plain answer's workers and rows (and their views), by its workers (the same
        # commands each step).
        self.plain: dict[tuple[int, ...], _Plain] = {}

    def run(self) -> None:
        try:
            self.serve()
        finally:
            self.memory.clear()  # the blocks its workers recorded in

    def serve(self) -> None:
        frames = self.frames
        while True:
            try:
                # Block while nothing is owed; else only look, and go back to the workers.
                message = frames.read() if self.owed == 0 or frames.ready() else None
            except (EOFError, OSError):
                return
            if message is not None and not self.handle(message):
                return
            if self.owed:
                self.collect()

    def collect(self) -> None:
        """Wait on the workers (one slice at most), and answer what is due."""
        # Enough replies to complete a round (the one closest to it), until what is held is
        # due or the pool speaks.
        want = min(self.left.values()) if self.left else self.owed
        limit = HOLD_LIMIT if self.hold else LOCAL_SLICE
        timeout = max(0.0, self.held_since + limit - time.monotonic()) if self.held else WAIT_SLICE
        if self.frames.whole():  # the pool's next message is in already: only look
            timeout = 0.0
        began = time.monotonic()
        # Nothing held yet: once the first reply is in, ``limit`` more at most (a wait for the
        # whole round would hold its fast workers' replies while a slow one hangs, past the
        # pool's step_timeout, and the pool would judge them hung too).
        linger = None if self.held else limit
        replies = self.local.wait(min(timeout, WAIT_SLICE), want, linger)
        now = time.monotonic()
        if replies and not self.held:
            # The first came ``limit`` before a wait it ended short (or when the wait began).
            short = len(replies) < want and not self.frames.whole()
            self.held_since = max(began, now - limit) if short else now
        for worker, reply in replies:
            self.receive(worker, reply)
        if self.held and (self.complete or self.bad or now - self.held_since >= limit):
            self.answer()

    def receive(self, worker: int, reply: Reply | WorkerLost | None) -> None:
        """Hold one reply of ``worker`` (a lost worker owes nothing more)."""
        if isinstance(reply, WorkerLost):
            self.drop(worker)
            self.held.append((worker, None, reply))
            self.bad = True
            return
        command, number = self.inflight[worker].popleft()
        self.owed -= 1
        self.tick(number)
        self.held.append((worker, command, reply))
        if reply is not None and reply.failures:
            self.bad = True

    def tick(self, number: int) -> None:
        """One reply of round ``number`` in."""
        left = self.left[number] - 1
        if left:
            self.left[number] = left
        else:
            del self.left[number]
            self.complete = True

    def drop(self, worker: int) -> None:
        """``worker`` owes nothing any more (lost, or rebuilt)."""
        for command, number in self.inflight[worker]:
            self.tick(number)
            self.records.pop(command, None)
        self.owed -= len(self.inflight[worker])
        self.inflight[worker].clear()

    def handle(self, message: Message) -> bool:
        """Take one message from the pool; False once it asked to close."""
        tag = message[:1]
        view = memoryview(message)
        if tag == wire.REPEAT:
            self.hold = self.owed == 0
            self.submit(self.last, view, 1)
            return True
        if tag == wire.SUBMIT or tag == wire.SUBMIT_APART:
            commands, at = wire.read_submit(view)
            self.last = commands
            self.last_actions = None
            whole = [w for w, _ in commands] == list(range(self.workers))
            self.in_order = [command for _, command in commands] if whole else None
            self.hold = self.owed == 0 and whole
            self.submit(commands, view, at)
            return True
        if tag == wire.MEMORY:  # answered at once, between the node's rounds
            local = self.local
            self.conn.send_bytes(wire.memory([local.memory(k) for k in range(self.workers)]))
            return True
        # A kill, a restart, a close: nothing waits for the rest, and what is in goes first.
        self.hold = False
        if self.held:
            self.answer()
        if tag == wire.KILL:
            self.local.kill(message[1] << 8 | message[2])
        elif tag == wire.RESTART:
            (worker, restarts), _ = wire.read_header(view)
            error: wire.Portable | None = None
            self.drop(worker)
            try:
                self.local.restart(worker, restarts)
            except EnvError as exc:
                error = wire.portable(exc)
            self.conn.send_bytes(wire.header(wire.ACK, error))
        elif tag == wire.CLOSE:
            self.local.close(5.0)
            self.conn.send_bytes(wire.header(wire.ACK, None))
            return False
        return True

    def submit(self, commands: list[tuple[int, Command]], view: memoryview, at: int) -> None:
        """One round: its actions into the batch, each command to its worker."""
        if self.actions:
            cached = self.last_actions
            if cached is None:
                ids = raw_rows.action_ids(c for _, c in commands)
                sel = raw_rows.selection(ids)
                cached = self.last_actions = (ids, sel, raw_rows.row_views(self.actions, sel))
            ids, sel, views = cached
            if views is not None:
                raw_rows.copy_into(views, view, at)
            else:
                raw_rows.unpack(self.actions, sel, ids.size, view, at)
        if not commands:
            return
        number = self.rounds
        self.rounds += 1
        self.left[number] = len(commands)
        self.owed += len(commands)
        inflight = self.inflight
        for worker, command in commands:
            inflight[worker].append((command, number))
            if self.recording is not None and type(command) is Sample:
                self.record(worker, command, self.recording)
        if self.hold and self.in_order is not None:  # a sync step: other cores' workers first
            self.local.submit_all(self.in_order)
            return
        submit = self.local.submit
        for worker, command in commands:
            submit(worker, command)

    def record(self, worker: int, command: Sample, recording: _Recording) -> None:
        """Give ``worker`` a block to record its part of ``command`` in (in place, or read
        there from its pipe)."""
        local, obs_space, act_space = recording
        rewards = self.batch.rewards.dtype
        steps, count = command.steps, len(command.env_ids)
        # Each worker's parts in the same few blocks again: it keeps them mapped.
        empty = functools.partial(self.memory.empty, hint=worker)
        fields = record_arrays(obs_space, act_space, steps, count, rewards, empty)
        into = Sampled(command.env_ids, steps, *fields, {}, {}, None)
        local.land(worker, command, into)
        self.records[command] = into

    def placed(self, held: list[_Held], recording: _Recording) -> None:
        """The parts recorded in place among ``held``, holding the arrays they were recorded
        in (sent from there)."""
        _, obs_space, act_space = recording
        for _, command, reply in held:
            into = self.records.pop(command, None) if command is not None else None
            if into is None or not isinstance(reply, Reply) or not reply.values:
                continue
            got = reply.values.get(into.env_ids[0])
            if isinstance(got, Sampled) and got.in_place:
                reply.values[into.env_ids[0]] = placed(got, into, obs_space, act_space)

    def answer(self) -> None:
        """Send the pool what is held: one message."""
        held, self.held = self.held, []
        self.complete = self.bad = False
        held.sort(key=_by_worker)  # the order the pool reads an answer in (stable: per worker)
        columns: list[Columns] = []
        if self.columns:
            columns = wire.join_columns(self.columns)
            self.columns.clear()
        if not self.objects and all(reply is None for _, _, reply in held):
            self.answer_plain(held, columns)
            return
        answered: list[tuple[Command, Reply | None]] = []
        for _, command, reply in held:
            if command is not None and not isinstance(reply, WorkerLost):
                answered.append((command, reply))
        rows = raw_rows.pack(self.rows, raw_rows.selection(raw_rows.row_ids(answered)), self.codecs)
        replies: list[tuple[int, Any]] = [(worker, reply) for worker, _, reply in held]
        if self.objects:
            observations = self.batch.observations
            replies = []
            for worker, command, reply in held:
                if command is not None and not isinstance(reply, WorkerLost):
                    got = raw_rows.row_ids([(command, reply)])
                    if got.size:
                        reply = reply if reply is not None else Reply(env_ids=tuple(got.tolist()))
                        reply.rows = Rows(got, [observations[i] for i in got.tolist()])
                replies.append((worker, reply))
        rollout = any(isinstance(command, Sample) for _, command, _ in held)  # copied at once
        if rollout and self.records and self.recording is not None:
            self.placed(held, self.recording)
        # A rollout's recorded arrays follow as a frame of their own, read into its columns.
        arrays = raw_parts.strip((reply for _, _, reply in held), self.codec) if rollout else None
        head = wire.header_parts(wire.GENERAL, (replies, columns), out_of_band=rollout)
        send(self.conn.fileno(), [*head, *rows])
        if arrays is not None:
            send(self.conn.fileno(), arrays)

    def answer_plain(self, held: list[_Held], columns: list[Columns]) -> None:
        """Every held reply is plain: the workers answered, the rows of their envs, and the
        infos that came as ``columns``."""
        key = tuple([worker for worker, _, _ in held])
        commands: list[Command] = [command for _, command, _ in held]  # type: ignore[misc]
        cached = self.plain.get(key)
        if cached is None or not all(map(is_, cached[0], commands)):
            if len(self.plain) > 64:
                self.plain.clear()
            ids = raw_rows.row_ids((command, None) for command in commands)
            sel = raw_rows.selection(ids)
            views = None if self.codecs else raw_rows.row_views(self.rows, sel)
            cached = self.plain[key] = (commands, wire.plain_workers(key), sel, views)
        _, workers, sel, views = cached
        rows = views if views is not None else raw_rows.pack(self.rows, sel, self.codecs)
        if columns:
            send(self.conn.fileno(), [wire.INFOS, workers, wire.pickled(columns), *rows])
        else:
            send(self.conn.fileno(), [wire.PLAIN, workers, *rows])


__all__ = ["HOLD_LIMIT", "LOCAL_SLICE", "WAIT_SLICE", "NodeServer"]
