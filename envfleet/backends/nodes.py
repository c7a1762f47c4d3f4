"""The Ray backend across nodes: one sub-pool per node, one message per node per command.

::

    pool (driver)                 node A: NodeAgent (Ray actor)        node B: NodeAgent ...
    ─────────────                 ─────────────────────────────
    submit_all(step) ── 1 msg ──► local ProcessTransport ─ pipes ─► worker processes
      (actions of A's envs)        (shared memory of node A)          (EnvGroup, global ids)
    wait: poll the nodes' ◄── 1 msg (rows of all of A's envs) ──
      sockets; rows land with one slice assignment per field

Ray places one :class:`~envfleet.backends.node_agent.NodeAgent` on each chosen node (pinned
with ``NodeAffinitySchedulingStrategy``), watches it and kills it; the data itself goes over a
TCP connection between the pool and each agent (listening on the node's Ray address, opened
with a per-pool secret handed to the agent through Ray, ``multiprocessing``'s challenge: a
stranger without it is dropped). The pool's workers are laid over the nodes in contiguous runs,
so a node's envs are consecutive rows: its rows arrive as the raw bytes of each field and are
written with ``np.frombuffer`` and one slice assignment, with no Python per env.

A node whose agent dies (or is killed: it did not stop a hung worker when asked) loses all its
workers: each is reported lost (:class:`~envfleet.backends.base.WorkerLost` naming the node).
Under ``on_error="restart"`` the first restart asks for a new agent, on the same node when Ray
still has it, else wherever Ray finds room, which builds all that node's envs restarted.
"""

from __future__ import annotations

import pickle
import secrets
import select
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from envfleet.backends import compression
from envfleet.backends import node_wire as wire
from envfleet.backends.base import BaseTransport, TransportOptions, WorkerLost
from envfleet.backends.channel import authenticated
from envfleet.backends.node_agent import NodeAgent, node_options, rebuild
from envfleet.backends.ray_options import RayOptions
from envfleet.backends.ray_session import connect, disconnect
from envfleet.backends.rows import deliver
from envfleet.buffers import Batch, ObjectRows
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Command, Reply
from envfleet.stats import NodeStats

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An agent that dies before it has started (placed on a node that just died) is replaced, up to
this many agents in all, ``START_BACKOFF`` seconds later and twice as long each time."""

KILL_GRACE = 2.0
"""Seconds an agent has to report lost a worker the pool asked it to kill, before the pool
kills the agent itself (it does not answer: stopped, or its node is gone)."""

CONNECT_TIMEOUT = 30.0
"""Seconds the pool gives an agent's socket to accept it and prove the key."""


def _cpus(node: dict[str, Any]) -> float:
    return float(node.get("Resources", {}).get("CPU", 0.0))


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's alive nodes that have CPUs, in a stable order (the head first as Ray lists it)."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n for n in nodes if n.get("Alive") and _cpus(n) > 0]


def place(nodes: Sequence[tuple[str, float]], workers: int) -> list[list[int]]:
    """Lay ``workers`` (consecutive indices) over ``nodes`` (id, CPUs) in contiguous runs: one
    each, the rest in proportion to their CPUs (largest remainder); with fewer workers than
    nodes, the nodes with the most CPUs get one."""
    n = len(nodes)
    weights = [max(cpus, 1e-9) for _, cpus in nodes]
    if workers < n:
        chosen = set(sorted(range(n), key=lambda k: -weights[k])[:workers])
        counts = [int(k in chosen) for k in range(n)]
    else:
        rest = workers - n
        shares = [rest * w / sum(weights) for w in weights]
        counts = [1 + int(s) for s in shares]
        by_remainder = sorted(range(n), key=lambda k: int(shares[k]) - shares[k])
        for k in by_remainder[: workers - sum(counts)]:
            counts[k] += 1
    runs, start = [], 0
    for count in counts:
        runs.append(list(range(start, start + count)))
        start += count
    return runs


def choose_nodes(wanted: str | Sequence[str]) -> list[tuple[str, float]]:
    """The nodes a pool asked for (``"auto"``: every alive node with CPUs) with their CPUs."""
    alive = {str(n["NodeID"]): _cpus(n) for n in alive_nodes()}
    if isinstance(wanted, str):
        if wanted != "auto":
            raise ValueError(f"nodes must be 'auto' or a list of Ray node ids, got {wanted!r}")
        return list(alive.items())
    unknown = [n for n in wanted if n not in alive]
    if unknown:
        raise ValueError(f"nodes {unknown} are not alive nodes of this Ray cluster")
    return [(n, alive[n]) for n in wanted]


@dataclass
class _Node:
    """One node's agent and what the pool owes it and is owed by it."""

    index: int
    node_id: str
    workers: list[int]  # global worker indices, in order (the agent's 0, 1, ...)
    agent: Any = None
    conn: Connection | None = None
    serving: Any = None
    host: str = ""
    pid: int = 0
    alive: bool = False
    lost: bool = False  # reported lost; waits for a restart
    inflight: list[deque[Command]] = field(default_factory=list)
    last: list[Command] | None = None  # the round the agent would repeat
    actions: tuple[np.ndarray, slice | np.ndarray] | None = None
    plain: dict[bytes, tuple[list[int], list[Command], np.ndarray, slice | np.ndarray]] = field(
        default_factory=dict
    )  # the rows of a plain answer, by the commands it answers (the same objects each step)
    why: str = ""  # why it was lost
    spawned: tuple[dict[int, int], bool] = ({}, False)  # the restarts and affinity it got
    killing: dict[int, float] = field(default_factory=dict)  # local worker: agent's deadline
    rebuilt: dict[int, dict[int, int]] = field(default_factory=dict)  # by a new agent
    messages: int = 0  # sent to it
    answers: int = 0  # received from it
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0  # message out to its answer in, summed
    sent_at: float = 0.0
    memory: list[int | None] = field(default_factory=list)  # per local worker, as last reported
    measuring: bool = False  # asked for its workers' memory, not answered yet


class NodeTransport(BaseTransport):
    """One agent per node; each node's commands and replies travel as one message."""

    def __init__(self, options: TransportOptions) -> None:
        extra = options.backend_options
        if not isinstance(extra, RayOptions):
            extra = RayOptions()
        self._options = options
        self._closed = False
        self._connected = False
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self._rows = wire.row_fields(self.batch)
        self._codecs = wire.row_codecs(self._rows, compression.codec(extra.compress))
        if extra.compress is not None and self._codecs is None:
            raise ValueError(
                f"compress={extra.compress!r} compresses image observations (uint8 arrays of "
                f"two or more dimensions a row); {options.observation_space} has none"
            )
        self._connected = connect(extra.address, dict(extra.ray_init_kwargs))
        self._actions = (
            wire.leaves(self.batch.actions)
            if not isinstance(self.batch.actions, ObjectRows)
            else []
        )
        self._space = options.observation_space
        self._authkey = secrets.token_bytes(32)
        self._nodes: list[_Node] = []
        self._where: list[tuple[_Node, int]] = []  # per global worker: its node, local index
        self._poller = select.poll()
        self._by_fd: dict[int, _Node] = {}
        self._queued: list[tuple[int, Reply | WorkerLost | None]] = []
        self._restarts = np.zeros(options.num_envs, dtype=np.int64)
        try:
            chosen = choose_nodes(extra.nodes or "auto")
            runs = place(chosen, len(options.assignment))
            for (node_id, _), workers in zip(chosen, runs, strict=True):
                if workers:
                    node = _Node(len(self._nodes), node_id, workers)
                    self._nodes.append(node)
            self._where = [(n, k) for n in self._nodes for k in range(len(n.workers))]
            self._agent_cls = ray.remote(NodeAgent)
            self._resources = {k: v for k, v in extra.worker_resources.items()}
            self._resources.setdefault("num_cpus", 0)
            for node in self._nodes:
                self._spawn(node, {}, soft=False)
            self._await(self._nodes)
        except BaseException:
            self.close(1.0)
            raise

    # -- starting agents -----------------------------------------------------------------------

    def _spawn(self, node: _Node, restarts: dict[int, int], soft: bool) -> None:
        node.spawned = (restarts, soft)
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=soft)
        node.agent = self._agent_cls.options(
            max_concurrency=1, max_restarts=0, scheduling_strategy=strategy, **self._resources
        ).remote(node_options(self._options, node.workers), restarts)
        node.inflight = [deque() for _ in node.workers]
        node.memory = [None] * len(node.workers)
        node.measuring = False
        node.last = None
        node.actions = None
        node.killing = {}

    def _await(self, nodes: Sequence[_Node]) -> None:
        """Wait until each of ``nodes`` has started its workers, then connect to it."""
        timeout = self._options.start_timeout
        deadline = time.monotonic() + timeout
        started = [(node, node.agent.start.remote(self._authkey)) for node in nodes]
        for node, ref in started:
            delay = START_BACKOFF
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    error, node_id, host, port, pid = ray.get(
                        ref, timeout=max(0.0, deadline - time.monotonic())
                    )
                    break
                except GetTimeoutError as exc:
                    self._kill_agent(node)
                    raise self._start_failed(
                        node, f"did not start within start_timeout={timeout:g}s", EnvTimeoutError
                    ) from exc
                except RayError as exc:
                    # Placed on a node that died (Ray may not know it dead yet): another agent.
                    if attempt == START_ATTEMPTS:
                        raise self._start_failed(
                            node, f"died while starting ({attempt} agents in a row): {exc}"
                        ) from exc
                    time.sleep(delay)
                    delay *= 2
                    restarts, _ = node.spawned
                    self._spawn(node, restarts, soft=True)
                    ref = node.agent.start.remote(self._authkey)
            if error is not None:
                self._kill_agent(node)
                raise rebuild(error, node.workers, self._options.spec.name)
            node.node_id, node.host, node.pid = node_id, host, pid
            node.serving = node.agent.serve.remote()
            try:
                node.conn = _connect_agent(host, port, self._authkey)
            except (OSError, EOFError, AuthenticationError) as exc:
                self._kill_agent(node)
                raise self._start_failed(node, f"could not be reached at {host}:{port}") from exc
            node.alive, node.lost = True, False
            self._by_fd[node.conn.fileno()] = node
            self._poller.register(node.conn.fileno(), select.POLLIN)

    def _start_failed(
        self, node: _Node, why: str, kind: type[WorkerDiedError] = WorkerDiedError
    ) -> WorkerDiedError:
        ids = tuple(i for w in node.workers for i in self._options.assignment[w])
        return kind(
            f"the agent of node {node.node_id} (workers {node.workers}, envs {list(ids)}) {why}",
            env_index=None,
            phase=Phase.MAKE,
            worker=node.workers[0],
            env_ids=ids,
        )

    # -- what the pool sees --------------------------------------------------------------------

    def layout(self) -> list[tuple[str, str, list[int], int]]:
        """Per node: its Ray node id, address, workers and number of envs."""
        assignment = self._options.assignment
        return [
            (n.node_id, n.host, list(n.workers), sum(len(assignment[w]) for w in n.workers))
            for n in self._nodes
        ]

    def memory(self, worker: int) -> int | None:
        """Resident bytes of ``worker``'s process as its agent last reported them (``None``:
        not yet, or gone); a call asks the node for fresh figures when it answered the last
        ask, so a later check of ``worker_memory_limit`` sees them, without a wait here."""
        node, local = self._where[worker]
        if node.alive and not node.measuring and node.conn is not None:
            try:
                node.conn.send_bytes(wire.MEMORY)
            except OSError:
                self._lose(node, "its connection broke")
                return None
            node.measuring = True
        return node.memory[local]

    def node_ids(self) -> list[str]:
        """The Ray node of each worker."""
        return [node.node_id for node, _ in self._where]

    def node_stats(self) -> list[dict[str, Any]]:
        """Per node: envs, workers, messages, bytes each way and mean round trip (seconds)."""
        out = []
        for (node_id, host, workers, envs), node in zip(self.layout(), self._nodes, strict=True):
            out.append(
                {
                    "node": node_id,
                    "address": host,
                    "workers": len(workers),
                    "envs": envs,
                    "messages": node.messages,
                    "answers": node.answers,
                    "bytes_out": node.bytes_out,
                    "bytes_in": node.bytes_in,
                    "round_trip": node.seconds / node.messages if node.messages else None,
                }
            )
        return out

    def nodes(self) -> tuple[NodeStats, ...]:
        return tuple(
            NodeStats(
                node=s["node"],
                address=s["address"],
                workers=s["workers"],
                envs=s["envs"],
                messages=s["messages"],
                answers=s["answers"],
                bytes_out=s["bytes_out"],
                bytes_in=s["bytes_in"],
                round_trip_ms=None if s["round_trip"] is None else s["round_trip"] * 1e3,
            )
            for s in self.node_stats()
        )

    def __repr__(self) -> str:
        parts = [f"{n[0][:8]}: {n[3]} envs/{len(n[2])} workers" for n in self.layout()]
        return f"NodeTransport({'; '.join(parts)})"

    # -- commands out --------------------------------------------------------------------------

    def prepare(self, worker: int, command: Command) -> None:
        """Pickle ``command`` now: what cannot travel fails before anything changes."""
        pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)

    def submit(self, worker: int, command: Command) -> None:
        node, local = self._where[worker]
        self._send_round(node, [local], [command])

    def submit_all(self, commands: Sequence[Command]) -> None:
        """A command for every worker: one message per node."""
        for node in self._nodes:
            self._send_round(node, range(len(node.workers)), [commands[w] for w in node.workers])

    def _send_round(self, node: _Node, locals_: Sequence[int], commands: list[Command]) -> None:
        for local, command in zip(locals_, commands, strict=True):
            node.inflight[local].append(command)
        if not node.alive:
            return  # reported lost on the next wait
        last = node.last
        repeat = last is not None and len(last) == len(commands)
        if repeat:
            assert last is not None
            for a, b in zip(last, commands, strict=True):
                if a is not b:
                    repeat = False
                    break
        if repeat:
            parts = [wire.REPEAT]
        else:
            parts = [wire.header(wire.SUBMIT, list(zip(locals_, commands, strict=True)))]
            node.last = commands if len(locals_) == len(node.workers) else None
            node.actions = None
        if self._actions:
            cached = node.actions
            if cached is None or not repeat:
                ids = wire.action_ids(commands)
                cached = node.actions = (ids, wire.selection(ids))
            parts += wire.pack(self._actions, cached[1])
        message = b"".join(parts)
        node.messages += 1
        node.bytes_out += len(message)
        node.sent_at = time.perf_counter()
        try:
            assert node.conn is not None
            node.conn.send_bytes(message)
        except OSError:
            self._lose(node, "its connection broke")

    # -- replies in ----------------------------------------------------------------------------

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        replies, self._queued = self._queued, []
        for node in self._nodes:
            if not node.alive and not node.lost:
                self._report_lost(node, replies)
        if replies:
            return replies
        deadline = None if timeout is None else time.monotonic() + timeout
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        while True:
            events = self._poller.poll(ms)
            for fd, _ in events:
                ready = self._by_fd.get(fd)
                if ready is not None and ready.alive:
                    self._read(ready, replies)
            for node in self._nodes:
                if node.killing and node.alive:
                    self._check_kills(node, replies)
                if not node.alive and not node.lost:
                    self._report_lost(node, replies)
            if len(replies) >= want or timeout == 0:
                return replies
            if any(isinstance(r, WorkerLost) or (r is not None and r.failures) for _, r in replies):
                return replies
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return replies
                ms = int(left * 1000 + 0.999)

    def _read(self, node: _Node, replies: list[tuple[int, Reply | WorkerLost | None]]) -> None:
        assert node.conn is not None
        try:
            data = node.conn.recv_bytes()
        except (EOFError, OSError):
            self._lose(node, "its connection closed (the agent or its node died)")
            return
        self._take(node, data, replies)

    def _take(
        self, node: _Node, data: bytes, replies: list[tuple[int, Reply | WorkerLost | None]]
    ) -> None:
        """Deliver the rows of one message from ``node`` and add its replies."""
        if data[:1] == wire.MEMORY:
            node.memory, node.measuring = wire.read_memory(data), False
            return
        node.answers += 1
        node.bytes_in += len(data)
        node.seconds += time.perf_counter() - node.sent_at
        tag = data[:1]
        workers = node.workers
        if tag == wire.PLAIN:
            key, at = wire.read_plain_workers(data)
            cached = node.plain.get(key)
            if cached is None:
                if len(node.plain) > 64:
                    node.plain.clear()
                order = np.frombuffer(key, np.uint16, offset=2).tolist()
                cached = node.plain[key] = (order, [], np.empty(0, np.intp), slice(0, 0))
            order, known, ids, sel = cached
            inflight = node.inflight
            commands = [inflight[k].popleft() for k in order]
            if len(known) != len(commands) or any(
                a is not b for a, b in zip(known, commands, strict=True)
            ):
                ids = wire.row_ids((c, None) for c in commands)
                sel = wire.selection(ids)
                node.plain[key] = (order, commands, ids, sel)
            wire.unpack(self._rows, sel, ids.size, data, at, self._codecs)
            replies.extend((workers[k], None) for k in order)
            return
        if tag == wire.ACK:  # pragma: no cover - only in answer to a restart or close
            return
        body, at = wire.read_header(data)
        answered: list[tuple[Command, Reply | None]] = []
        out: list[tuple[int, Reply | WorkerLost | None]] = []
        for local, reply in body:
            if isinstance(reply, WorkerLost):
                node.inflight[local].clear()
                out.append((workers[local], reply))
                continue
            command = node.inflight[local].popleft()
            answered.append((command, reply))
            if reply is not None:
                for failure in reply.restarts:
                    if failure.env_index is not None:
                        self._restarts[failure.env_index] += 1
                if reply.rows is not None:  # pickled observations
                    deliver(self.batch, self._space, reply)
            out.append((workers[local], reply))
        ids = wire.row_ids(answered)
        wire.unpack(self._rows, wire.selection(ids), ids.size, data, at, self._codecs)
        replies.extend(out)

    def _lose(self, node: _Node, why: str) -> None:
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
            node.conn.close()
            node.conn = None
        self._kill_agent(node)

    def _report_lost(
        self,
        node: _Node,
        replies: list[tuple[int, Reply | WorkerLost | None]],
        but: int | None = None,
    ) -> None:
        """Report each of ``node``'s workers lost (but its local worker ``but``)."""
        node.lost = True
        reason = f"the agent of node {node.node_id} ({node.host}) is gone: {node.why}"
        for k, worker in enumerate(node.workers):
            node.inflight[k].clear()
            if k != but:
                replies.append((worker, WorkerLost(None, reason)))

    # -- killing and restarting ----------------------------------------------------------------

    def kill(self, worker: int) -> None:
        """Have ``worker``'s agent kill it (it hangs); should the agent not report it lost
        within :data:`KILL_GRACE` (the agent hangs too), the agent is killed: its whole node is
        lost."""
        node, local = self._where[worker]
        if not node.alive:
            return
        try:
            assert node.conn is not None
            node.conn.send_bytes(wire.KILL + bytes([local >> 8, local & 0xFF]))
        except OSError:
            self._lose(node, "its connection broke")
            return
        node.killing.setdefault(local, time.monotonic() + KILL_GRACE)

    def _check_kills(
        self, node: _Node, replies: list[tuple[int, Reply | WorkerLost | None]]
    ) -> None:
        """Forget the kills the agent reported; kill the agent past the grace of one."""
        reported = {w for w, r in replies if isinstance(r, WorkerLost)}
        for local in [k for k in node.killing if node.workers[k] in reported]:
            del node.killing[local]
        if node.killing and time.monotonic() > min(node.killing.values()):
            self._lose(node, f"killed: it did not stop a hung worker within {KILL_GRACE:g}s")

    def _kill_agent(self, node: _Node) -> None:
        if node.agent is not None:
            try:
                ray.kill(node.agent, no_restart=True)
            except Exception:
                pass

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        node, local = self._where[worker]
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
            self._report_lost(node, self._queued, but=local)
            self.restart(worker, restarts)
            return
        node.memory[local] = None  # the old process's figure
        if error is not None:
            raise rebuild(error, node.workers, self._options.spec.name)

    def _ack(self, node: _Node) -> Any:
        """Read ``node``'s messages up to its acknowledgement (the others wait for ``wait``)."""
        while True:
            assert node.conn is not None
            if not node.conn.poll(self._options.start_timeout):
                self._lose(node, "did not answer a restart within start_timeout")
                raise self._start_failed(node, "did not answer a restart", EnvTimeoutError)
            data = node.conn.recv_bytes()
            if data[:1] == wire.ACK:
                body, _ = wire.read_header(data)
                return body
            self._take(node, data, self._queued)  # another worker's reply came first

    # -- closing -------------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            deadline = time.monotonic() + timeout
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
        finally:
            for node in self._nodes:
                if node.conn is not None:
                    node.conn.close()
                    node.conn = None
                node.alive = False
                if ray.is_initialized():
                    self._kill_agent(node)
            if self._connected:
                self._connected = False
                disconnect()


def _connect_agent(host: str, port: int, authkey: bytes) -> Connection:
    """A connection to an agent that proved it knows ``authkey`` (and to which we proved it)."""
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return authenticated(sock, authkey, CONNECT_TIMEOUT)


def open_transport(options: TransportOptions) -> NodeTransport:
    return NodeTransport(options)
