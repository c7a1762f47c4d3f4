"""A node's agent: the Ray actor that runs one node's envs as a local process pool.

Ray places one agent on each node of the pool (pinned there), and it starts the node's worker
processes with the process backend's own transport (:mod:`envfleet.backends.process`: shared
memory, the same worker loop and stepping loop), holding the pool's *global* env indices, seeds
and restart counts, so trajectories are those of one machine. It then serves the pool over one
authenticated TCP connection (:meth:`NodeAgent.serve`, the messages of
:mod:`envfleet.backends.node_wire`): a round of commands in, the local replies and rows of the
whole node out, one message each way. The pool's side is :mod:`envfleet.backends.nodes`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import ray

from envfleet.backends import node_wire as wire
from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.backends.channel import accept_pool
from envfleet.backends.compression import Codec, codec
from envfleet.backends.process import ProcessTransport
from envfleet.buffers import ObjectRows
from envfleet.errors import EnvError, EnvTimeoutError, WorkerDiedError
from envfleet.protocol import Command, EnvFailure, Reply, Rows

LOCAL_SLICE = 0.002
"""Seconds the agent waits on its workers at a time while it owes replies, before it looks
for a message from the pool (a kill, another round): the agent has one thread."""

HOLD_LIMIT = 0.05
"""Seconds at most the agent holds the replies of a sync step's fast workers while a slow one
finishes, to send the node's answer as one message: past it, what is in goes, so that the
pool's ``step_timeout`` sees a hung worker's fast neighbours answer (a ``step_timeout`` this
short would blame them)."""

DEFAULT_CONTEXT = "forkserver"
"""How the agent starts its worker processes: a Ray worker runs threads, which ``fork`` would
copy in whatever state they are; a fork server is started clean once."""


@dataclass(frozen=True)
class NodeOptions(TransportOptions):
    """A pool's options for one node's workers: their envs keep their global indices (rows of a
    batch as large as the whole pool's)."""

    rows: int = 0

    @property
    def num_envs(self) -> int:
        return self.rows


def node_options(options: TransportOptions, workers: Sequence[int]) -> NodeOptions:
    """``options`` for the node that runs ``workers`` (global worker indices)."""
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    values["assignment"] = [tuple(options.assignment[w]) for w in workers]
    values["context"] = options.context or DEFAULT_CONTEXT
    return NodeOptions(**values, rows=options.num_envs)


Portable = tuple[Any, ...]
"""An :class:`~envfleet.errors.EnvError` in a form that pickles (the error itself does not:
its ``__init__`` takes keyword arguments, and an env's error is an instance of a class made on
the fly), see :func:`portable` and :func:`rebuild`."""


def portable(exc: EnvError) -> Portable:
    """``exc`` as plain data, to cross to the pool."""
    if isinstance(exc, WorkerDiedError):
        return (
            "died",
            isinstance(exc, EnvTimeoutError),
            str(exc),
            exc.env_index,
            exc.phase,
            exc.worker,
            exc.exitcode,
            exc.env_ids,
        )
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return ("raised", EnvFailure.capture(exc.env_index, exc.phase, cause), exc.worker)


def rebuild(data: Portable, workers: Sequence[int], env_name: str) -> Exception:
    """The error :func:`portable` describes, naming the pool's worker (``workers``: the pool's
    index of each of the agent's workers); ``("missing", message)``: a module the node lacks,
    an ``ImportError``."""
    if data[0] == "missing":
        return ImportError(data[1])
    if data[0] == "raised":
        _, failure, worker = data
        error: EnvError = failure.to_error(workers[worker], env_name)
        return error
    _, timeout, message, env_index, phase, worker, exitcode, env_ids = data
    kind = EnvTimeoutError if timeout else WorkerDiedError
    return kind(
        message,
        env_index=env_index,
        phase=phase,
        worker=workers[worker],
        exitcode=exitcode,
        env_ids=env_ids,
    )


class NodeAgent:
    """One node's envs in a local process pool, served to the pool over one connection."""

    def __init__(self, options: NodeOptions, restarts: dict[int, int]) -> None:
        self.options = options
        self.restarts = restarts
        self.local: ProcessTransport | None = None
        self._listener: socket.socket | None = None
        self._authkey = b""
        self._codec: Codec | None = None

    def start(self, authkey: bytes) -> tuple[Portable | None, str, str, int, int]:
        """Start the node's workers and a listening socket on this node's address; return
        ``(error or None, node id, address, port, pid)``."""
        node = str(ray.get_runtime_context().get_node_id())
        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        try:
            self._codec = codec(getattr(self.options.backend_options, "compress", None))
        except ImportError as exc:  # lz4 on the pool's machine, not on this node
            return ("missing", f"node {node} ({host}): {exc}"), node, host, 0, os.getpid()
        try:
            self.local = ProcessTransport(self.options)
            # A replacement agent: its envs start restarted (flagged, reseeded by their count).
            for worker, ids in enumerate(self.options.assignment):
                counts = {i: self.restarts[i] for i in ids if i in self.restarts}
                if counts:
                    self.local.restart(worker, counts)
        except EnvError as exc:
            return portable(exc), node, host, 0, os.getpid()
        self._authkey = authkey
        self._listener = socket.create_server((host, 0), backlog=8)
        port = int(self._listener.getsockname()[1])
        return None, node, host, port, os.getpid()

    def serve(self) -> None:
        """Serve the pool until it closes the agent or goes away; then close the envs."""
        assert self._listener is not None and self.local is not None
        try:
            conn = accept_pool(self._listener, self._authkey)
        finally:
            self._listener.close()
            self._listener = None
        sock = socket.socket(fileno=conn.fileno())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.detach()
        try:
            with conn:
                _Server(self.local, conn, len(self.options.assignment), self._codec).run()
        finally:
            self.local.close(5.0)


class _Server:
    """The agent's loop: rounds in, the node's replies and rows out."""

    def __init__(
        self, local: ProcessTransport, conn: Connection, workers: int, codec: Codec | None
    ) -> None:
        self.local = local
        self.conn = conn
        batch = local.batch
        self.batch = batch
        self.rows = wire.row_fields(batch)
        self.codecs = wire.row_codecs(self.rows, codec)
        self.objects = isinstance(batch.observations, ObjectRows)
        self.actions = (
            wire.leaves(batch.actions) if not isinstance(batch.actions, ObjectRows) else []
        )
        self.inflight: list[deque[Command]] = [deque() for _ in range(workers)]
        self.owed = 0
        self.last: list[tuple[int, Command]] = []
        self.last_actions: tuple[np.ndarray, slice | np.ndarray] | None = None
        self.workers = workers
        # A whole round (a command for every worker, nothing else owed: a sync step) is
        # answered in one message, once every worker has replied (or one failed or was lost,
        # or HOLD_LIMIT passed); otherwise (async) what is in goes every LOCAL_SLICE.
        self.hold = False
        self.held: list[tuple[int, Reply | WorkerLost | None]] = []
        self.held_since = 0.0

    def run(self) -> None:
        conn = self.conn
        while True:
            try:
                # Block while nothing is owed; else only look, and go back to the workers.
                message = conn.recv_bytes() if self.owed == 0 or conn.poll(0) else None
            except (EOFError, OSError):
                return
            if message is not None and not self.handle(message):
                return
            if self.owed:
                want = self.owed - len(self.held)
                if want > 0:
                    replies = self.local.wait(LOCAL_SLICE, want)
                    if replies and not self.held:
                        self.held_since = time.monotonic()
                    self.held += replies
                if self.held and (
                    not self.hold
                    or len(self.held) >= self.owed
                    or any(_bad(reply) for _, reply in self.held)
                    or time.monotonic() - self.held_since >= HOLD_LIMIT
                ):
                    held, self.held = self.held, []
                    self.answer(held)

    def handle(self, message: bytes) -> bool:
        """Take one message from the pool; False once it asked to close."""
        tag = message[:1]
        view = memoryview(message)
        if tag == wire.REPEAT:
            self.hold = self.owed == 0
            self.submit(self.last, view, 1)
            return True
        if tag == wire.SUBMIT:
            commands, at = wire.read_header(view)
            self.last = commands
            self.last_actions = None
            self.hold = self.owed == 0 and [w for w, _ in commands] == list(range(self.workers))
            self.submit(commands, view, at)
            return True
        if tag == wire.MEMORY:  # answered at once, between the node's rounds
            local = self.local
            self.conn.send_bytes(wire.memory([local.memory(k) for k in range(self.workers)]))
            return True
        # A kill, a restart, a close: nothing waits for the rest, and what is in goes first.
        self.hold = False
        if self.held:
            held, self.held = self.held, []
            self.answer(held)
        if tag == wire.KILL:
            self.local.kill(message[1] << 8 | message[2])
        elif tag == wire.RESTART:
            (worker, restarts), _ = wire.read_header(view)
            error: Portable | None = None
            self.owed -= len(self.inflight[worker])
            self.inflight[worker].clear()
            try:
                self.local.restart(worker, restarts)
            except EnvError as exc:
                error = portable(exc)
            self.conn.send_bytes(wire.header(wire.ACK, error))
        elif tag == wire.CLOSE:
            self.local.close(5.0)
            self.conn.send_bytes(wire.header(wire.ACK, None))
            return False
        return True

    def submit(self, commands: list[tuple[int, Command]], view: memoryview, at: int) -> None:
        if self.actions:
            cached = self.last_actions
            if cached is None:
                ids = wire.action_ids(c for _, c in commands)
                cached = self.last_actions = (ids, wire.selection(ids))
            ids, sel = cached
            wire.unpack(self.actions, sel, ids.size, view, at)
        for worker, command in commands:
            self.inflight[worker].append(command)
            self.owed += 1
            self.local.submit(worker, command)

    def answer(self, replies: list[tuple[int, Reply | WorkerLost | None]]) -> None:
        """Send the pool what came in: one message."""
        replies.sort(key=lambda item: item[0])  # the order the pool reads a plain answer in
        answered: list[tuple[Command, Reply | None]] = []
        general = self.objects
        for worker, reply in replies:
            if isinstance(reply, WorkerLost):
                self.owed -= len(self.inflight[worker])
                self.inflight[worker].clear()
                general = True
                continue
            command = self.inflight[worker].popleft()
            self.owed -= 1
            if reply is not None:
                general = True
            answered.append((command, reply))
        ids = wire.row_ids(answered)
        sel = wire.selection(ids)
        rows = wire.pack(self.rows, sel, self.codecs)
        if general:
            if self.objects:
                observations = self.batch.observations
                by_reply: list[tuple[int, Any]] = []
                k = 0
                for worker, reply in replies:
                    if isinstance(reply, WorkerLost):
                        by_reply.append((worker, reply))
                        continue
                    command, _ = answered[k]
                    k += 1
                    got = wire.row_ids([(command, reply)])
                    if got.size:
                        reply = reply if reply is not None else Reply(env_ids=tuple(got.tolist()))
                        reply.rows = Rows(got, [observations[i] for i in got.tolist()])
                    by_reply.append((worker, reply))
                replies = by_reply
            self.conn.send_bytes(b"".join([wire.header(wire.GENERAL, replies), *rows]))
        else:
            workers = wire.plain_workers([worker for worker, _ in replies])
            self.conn.send_bytes(b"".join([wire.PLAIN, workers, *rows]))


def _bad(reply: Reply | WorkerLost | None) -> bool:
    """A reply the pool should see at once (a worker lost, an env failed)."""
    return isinstance(reply, WorkerLost) or (reply is not None and bool(reply.failures))
