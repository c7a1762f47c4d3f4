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
of their own (:mod:`~envfleet.backends.contract.raw_parts`), sent from where its workers
recorded them (:mod:`~envfleet.backends.nodes.recording`).

Each message from the pool is a round, and each round is answered as soon as all of its
replies are in, whatever else the node owes: with two halves of the node's envs in flight
(async, ``batch_size < num_envs``, one round each), the first half's rows go while the other
half steps, so the pool sends that half's next actions before the node's cores run out of
work. A sync step is one round of every worker, answered in one message. The messages are
:mod:`envfleet.backends.nodes.wire`'s; the agent that runs this loop is
:class:`~envfleet.backends.nodes.agent.NodeAgent`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from operator import is_, itemgetter
from typing import Any

import gymnasium
import numpy as np

from envfleet.backends.contract import raw_parts
from envfleet.backends.contract.base import LandsParts, LocalPool, Replies, WorkerLost
from envfleet.backends.nodes import raw_rows, wire
from envfleet.backends.nodes.compression import Codec
from envfleet.backends.nodes.frames import Frames, Message, send
from envfleet.backends.nodes.recording import PartBlocks
from envfleet.buffers import ObjectRows
from envfleet.errors import EnvError
from envfleet.info_columns import Columns
from envfleet.protocol import Command, Reply, Rows, Sample, Step

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

IN_ORDER_LIMIT = 0.002
"""Seconds at most the agent reads a sync step's replies in the workers' order
(:meth:`NodeServer.step_plain`, for a round last answered within it: slower envs would wait it
out every step) before it waits on them all (:meth:`NodeServer.collect`)."""

_Held = tuple[int, "Command | None", "Reply | WorkerLost | None"]
"""A reply in, not yet sent: local worker, the command it answers (``None``: lost), reply."""

_Plain = tuple[list[Command], bytes, "slice | np.ndarray", "list[memoryview] | None"]
"""A plain answer's commands, its workers part, its rows, and their views (``None``: packed)."""

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
        batch = local.batch
        self.parts: PartBlocks | None = None  # where the workers record their rollouts' parts
        if isinstance(local, LandsParts) and spaces is not None:
            self.parts = PartBlocks(local, spaces, batch.rewards.dtype, workers)
        # The infos the workers sent as columns since the last answer (``local`` appends them
        # as it reads the replies they belong to: those replies are held, and go with them).
        self.columns: list[Columns] = [] if columns is None else columns
        self.conn = conn
        self.frames = Frames(conn.fileno())  # the pool's messages, read in one go each
        local.watch(conn.fileno())  # its wait ends when the pool speaks
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
        self.hold = False  # a sync step's round: held up to HOLD_LIMIT, not LOCAL_SLICE
        # The last round's commands in the workers' order, when it named every worker in it.
        self.in_order: list[Command] | None = None
        self.stepping = False  # and they are all steps
        self.began = 0.0  # when the last round went out
        self.whole_plain: _Plain | None = None  # their plain answer: step_plain sends it again
        self.held: list[_Held] = []
        self.held_since = 0.0
        self.complete = False  # a round is all in since the last answer
        self.bad = False  # a failure or a lost worker is held: it goes at once
        # A plain answer's workers and rows (and their views), by its workers.
        self.plain: dict[tuple[int, ...], _Plain] = {}

    def run(self) -> None:
        try:
            self.serve()
        finally:
            if self.parts is not None:
                self.parts.clear()

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

    def step_plain(self, view: memoryview) -> None:
        """The sync step's hot path: a repeat of a round of every worker stepping, answered
        plainly (:attr:`whole_plain`). Its replies read in the workers' order, each waited for
        on its own pipe (a wait on every pipe wakes the agent once per reply that comes apart),
        with no bookkeeping while each is one plain reply; then the same answer. A worker not in
        within :data:`IN_ORDER_LIMIT`, a reply that says more or a lost worker: the round is
        held as :meth:`submit` holds one, and :meth:`collect` goes on."""
        cached = self.whole_plain
        assert cached is not None and cached[3] is not None
        self.began = time.monotonic()
        self.write_actions(self.last, view, 1)
        self.local.submit_all(cached[0])
        read, deadline = self.local.read_plain, self.began + IN_ORDER_LIMIT
        for worker in range(self.workers):
            replies = read(worker, max(0.0, deadline - time.monotonic()))
            if replies is not None:
                self.held_over(worker, replies)
                return
        self.send_plain(cached[1], cached[3])

    def held_over(self, worker: int, replies: Replies) -> None:
        """:meth:`step_plain` goes no further at ``worker`` (``replies``: what it sent): the
        round as :meth:`submit` would have it, the workers before ``worker`` answered plainly."""
        self.hold = True
        self.book(self.last)
        for w in range(worker):
            self.receive(w, None)
        for w, reply in replies:
            self.receive(w, reply)
        if self.held:
            self.held_since = time.monotonic()
            if self.bad or self.complete:
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
            if self.parts is not None:
                self.parts.forget(command)
        self.owed -= len(self.inflight[worker])
        self.inflight[worker].clear()

    def handle(self, message: Message) -> bool:
        """Take one message from the pool; False once it asked to close."""
        tag = message[:1]
        view = memoryview(message)
        if tag == wire.REPEAT:
            if self.whole_plain is not None and self.owed == 0 and not self.frames.whole():
                self.step_plain(view)
                return True
            self.hold = self.owed == 0
            self.submit(self.last, view, 1)
            return True
        if tag == wire.SUBMIT or tag == wire.SUBMIT_APART:
            commands, at = wire.read_submit(view)
            self.last = commands
            self.last_actions = self.whole_plain = None
            whole = [w for w, _ in commands] == list(range(self.workers))
            self.in_order = [command for _, command in commands] if whole else None
            self.stepping = whole and all(type(command) is Step for _, command in commands)
            self.hold = self.owed == 0 and whole
            self.submit(commands, view, at)
            return True
        self.whole_plain = None
        return self.control(tag, message, view)

    def control(self, tag: bytes | bytearray, message: Message, view: memoryview) -> bool:
        """A message that is not a round; False once the pool asked to close."""
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

    def write_actions(self, commands: list[tuple[int, Command]], view: memoryview, at: int) -> None:
        """A round's actions (``view``, from ``at``) into the batch."""
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

    def submit(self, commands: list[tuple[int, Command]], view: memoryview, at: int) -> None:
        """One round: its actions into the batch, each command to its worker."""
        self.began = time.monotonic()
        self.write_actions(commands, view, at)
        if not commands:
            return
        self.book(commands)
        if self.hold and self.in_order is not None:  # a sync step: other cores' workers first
            self.local.submit_all(self.in_order)
            return
        submit = self.local.submit
        for worker, command in commands:
            submit(worker, command)

    def book(self, commands: list[tuple[int, Command]]) -> None:
        """A round's commands in flight, each with its round's number (a rollout's part given
        a block to be recorded in)."""
        number = self.rounds
        self.rounds += 1
        self.left[number] = len(commands)
        self.owed += len(commands)
        for worker, command in commands:
            self.inflight[worker].append((command, number))
            if self.parts is not None and type(command) is Sample:
                self.parts.record(worker, command)

    def answer(self) -> None:
        """Send the pool what is held: one message."""
        held, self.held = self.held, []
        self.complete = self.bad = False
        held.sort(key=_by_worker)  # the order the pool reads an answer in (stable: per worker)
        if not self.objects and all(reply is None for _, _, reply in held):
            self.answer_plain(held)
            return
        columns = wire.join_columns(self.columns) if self.columns else []
        self.columns.clear()
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
        if rollout and self.parts is not None:
            self.parts.placed(held)
        # A rollout's recorded arrays follow as a frame of their own, read into its columns.
        arrays = raw_parts.strip((reply for _, _, reply in held), self.codec) if rollout else None
        head = wire.header_parts(wire.GENERAL, (replies, columns), out_of_band=rollout)
        send(self.conn.fileno(), [*head, *rows])
        if arrays is not None:
            send(self.conn.fileno(), arrays)

    def answer_plain(self, held: list[_Held]) -> None:
        """Every held reply is plain: the workers answered, the rows of their envs, and the
        infos that came as columns."""
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
        quick = time.monotonic() - self.began < IN_ORDER_LIMIT and len(key) == self.workers
        whole = quick and self.stepping and all(map(is_, commands, self.in_order or ()))
        self.whole_plain = cached if whole and views is not None else None
        rows = views if views is not None else raw_rows.pack(self.rows, sel, self.codecs)
        self.send_plain(workers, rows)

    def send_plain(self, workers: bytes, rows: Sequence[bytes | memoryview]) -> None:
        """A plain answer: ``workers`` answered, their ``rows``, and the infos that came as
        columns since the last answer."""
        if self.columns:
            columns = wire.join_columns(self.columns)
            self.columns.clear()
            send(self.conn.fileno(), [wire.INFOS, workers, wire.pickled(columns), *rows])
        else:
            send(self.conn.fileno(), [wire.PLAIN, workers, *rows])


__all__ = ["HOLD_LIMIT", "IN_ORDER_LIMIT", "LOCAL_SLICE", "WAIT_SLICE", "NodeServer"]
