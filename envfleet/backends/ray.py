"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). Results larger than Ray returns
inline (images) travel in pieces that it does (:meth:`GroupActor.run_chunked`). A dead actor or
node surfaces as a :class:`~envfleet.backends.base.WorkerLost`, like a dead process; an actor
that dies before it has built its envs (placed on a node that just died) is replaced.

Actors on the pool's own machine skip Ray's per-call path altogether: the batch arrays live in
memory they map too (:mod:`~envfleet.backends.node_memory`) and commands and replies go over a
Unix socket, through the loop the process backend's workers run
(:func:`~envfleet.backends.channel.serve_connection`). Ray then only places, starts, watches
and kills them; on one machine that makes the ray backend about as fast as the process backend.
Actors on other machines get each command as a Ray call, their actions carried in it.

Connections: a pool joins the Ray this process is already connected to, and then leaves it
alone. Otherwise it calls ``ray.init`` itself (a new local Ray sized for this machine with no
address, or the cluster at ``address``), and the last pool on that connection to close calls
``ray.shutdown``: that stops a Ray envfleet started, and only disconnects from a cluster it
joined (which keeps running).

Ray is an optional extra (``pip install envfleet[ray]``): this module alone imports it.
"""

from __future__ import annotations

import math
import mmap
import pickle
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Iterable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import cloudpickle
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from envfleet.backends import node_memory
from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.backends.channel import PickledCommands, serve_connection
from envfleet.backends.node_memory import NodeMemory, PoolMemory
from envfleet.buffers import Batch, ObjectRows, is_array_space, make_reader, take
from envfleet.errors import Phase, WorkerDiedError
from envfleet.group import GroupStartError
from envfleet.protocol import Close, Command, EnvFailure, Group, Reply, Reset, Rows, Step
from envfleet.worker import build_group

START_TIMEOUT = 300.0
"""Seconds an actor may take to be placed and build its envs before the pool gives up on it
(an actor asking for resources no node has would otherwise wait forever)."""

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An actor that dies before it has built its envs is replaced, up to this many actors in all,
``START_BACKOFF`` seconds later and twice as long each time (about 8 s in all)."""

Packed = tuple[
    np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray, "dict[int, dict[str, Any]] | None"
]
"""A step's or reset's reply with nothing but results: ``(env_ids, observations, rewards,
terminations, truncations, infos)``, rows in ``env_ids`` order."""

CHUNK_BYTES = 90 * 1024
"""Results of a step or reset expected to be larger travel in pieces of about this size (under
Ray's 100 KiB limit for results returned inline), see :meth:`GroupActor.run_chunked`."""

MIXED_WAIT_SLICE = 0.001
"""With commands in flight both on same-machine actors (sockets) and on others (Ray calls), the
pool waits on each kind in turn this many seconds at a time."""

_lock = threading.Lock()
_session: str | None = None  # the Ray connection envfleet made (see _session_id), if any
_users = 0  # open transports on that connection


class GroupActor:
    """The actor: one group of envs, and the batch arrays it writes its rows of.

    On the pool's machine those are the pool's own (mapped from its memory file) and the actor
    serves commands from a socket (:meth:`serve`); elsewhere they are ``np.zeros`` of the full
    pool size, of which only this actor's rows are ever touched (untouched zero pages cost no
    memory), and each command is a Ray call (:meth:`run`).
    """

    def __init__(self, options: TransportOptions, worker: int, restarts: dict[int, int]) -> None:
        self.options = options
        self.worker = worker
        self.restarts = restarts
        self.batch = Batch.local(options.observation_space, options.action_space, 0)
        self.group: Group | None = None
        self._memory: mmap.mmap | None = None  # keeps the pool's memory mapped
        self._listener: Listener | None = None

    def start(
        self, memory: NodeMemory | None, pool_node: str | None, authkey: bytes
    ) -> tuple[Reply, str, str | None]:
        """Build the envs; return the outcome, this actor's node and, on the pool's machine,
        the socket address to serve the pool on (``None``: use Ray calls)."""
        options = self.options
        node = str(ray.get_runtime_context().get_node_id())
        shared = False
        if memory is not None and node == pool_node:
            try:
                self.batch, self._memory = memory.attach()
                shared = True
            except OSError:
                pass  # not the pool's machine after all, or no access: Ray calls it is
        if not shared:
            self.batch = Batch.local(
                options.observation_space, options.action_space, options.num_envs
            )
        try:
            self.group = build_group(
                options,
                options.assignment[self.worker],
                self.batch,
                ship_observations=shared and isinstance(self.batch.observations, ObjectRows),
                restarts=self.restarts,
            )
        except GroupStartError as exc:
            return Reply(failures=(exc.failure,)), node, None
        except Exception as exc:
            return Reply(failures=(EnvFailure.capture(None, Phase.MAKE, exc),)), node, None
        address = None
        if shared:
            # An abstract socket: no file to leave behind; the key keeps others out.
            name = f"\0envfleet-{secrets.token_hex(12)}"
            self._listener = Listener(name, family="AF_UNIX", authkey=authkey)
            address = name
        return Reply(), node, address

    def serve(self) -> None:
        """Serve the pool's commands from the socket until it closes the pool (or goes away)."""
        assert self._listener is not None and self.group is not None
        with self._listener.accept() as conn:
            self._listener.close()
            serve_connection(self.group, conn)

    def run(self, command: Command) -> Reply | Packed:
        assert self.group is not None
        reply = command.run(self.group)
        if reply.infos or reply.values:
            # Ray pickles the reply after this returns, where a failure would lose the rows.
            try:
                cloudpickle.dumps((reply.infos, reply.values))
            except Exception as exc:
                reply = Reply(
                    env_ids=reply.env_ids,
                    failures=(*reply.failures, _unpicklable(exc)),
                    restarts=reply.restarts,
                )
        if not (command.delivers_envs and reply.env_ids):
            return reply
        failed = {f.env_index for f in reply.failures}
        ids = np.array([i for i in reply.env_ids if i not in failed], dtype=np.intp)
        batch = self.batch
        observations = batch.observations
        rows = Rows(
            env_ids=ids,
            # Spaces that are not arrays travel as a list of per-env values.
            observations=[observations[i] for i in ids.tolist()]
            if isinstance(observations, ObjectRows)
            else take(self.options.observation_space, observations, ids),
            rewards=batch.rewards[ids],
            terminations=batch.terminations[ids],
            truncations=batch.truncations[ids],
        )
        if reply.failures or reply.restarts or reply.observations:
            reply.rows = rows
            return reply
        # The common case travels as a tuple: Ray pickles it faster than the dataclasses.
        return (
            ids,
            rows.observations,
            rows.rewards,
            rows.terminations,
            rows.truncations,
            reply.infos,
        )

    def run_chunked(self, command: Command, chunks: int) -> tuple[bytes, ...]:
        """:meth:`run`, its result pickled and cut in ``chunks`` pieces for Ray to return.

        Ray returns a result under 100 KiB inline, in the reply to the call, and a larger one
        through its object store, which costs a round trip through the raylet on each side
        (about 40% of the time of a step of 8 Pong envs over 2 actors, on 2 cores here). The
        observations of a few images are larger: in pieces under that size, they travel inline.
        """
        data = cloudpickle.dumps(self.run(command), protocol=5)
        size = -(-len(data) // chunks)
        return tuple(data[k * size : (k + 1) * size] for k in range(chunks))


def _unpack(result: Reply | Packed) -> Reply:
    """The :class:`Reply` an actor's :meth:`GroupActor.run` result stands for."""
    if isinstance(result, Reply):
        return result
    ids, observations, rewards, terminations, truncations, infos = result
    rows = Rows(ids, observations, rewards, terminations, truncations)
    return Reply(env_ids=tuple(ids.tolist()), infos=infos, rows=rows)


def _unpicklable(exc: Exception) -> EnvFailure:
    try:
        raise TypeError(f"the reply could not be pickled to send to the pool: {exc}") from exc
    except TypeError as error:
        return EnvFailure.capture(None, Phase.STEP, error)


def _session_id() -> str:
    """What identifies the Ray this process is connected to (its GCS address)."""
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection may not say
        return "connected"


def _connect(address: str | None, init_kwargs: dict[str, Any]) -> bool:
    """Join this process's Ray, or connect it to one; True when envfleet owns the connection."""
    global _session, _users
    with _lock:
        if ray.is_initialized():
            if _session is not None and _session == _session_id():
                _users += 1
                return True
            return False  # the caller's connection: used, never shut down
        kwargs = dict(init_kwargs)
        if address is not None:
            kwargs["address"] = address
        if not str(kwargs.get("address") or "").startswith("ray://"):  # Ray Client takes few
            kwargs = {"include_dashboard": False, "log_to_driver": False, **kwargs}
        ray.init(**kwargs)
        _session, _users = _session_id(), 1
        return True


def _disconnect() -> None:
    """One transport on envfleet's connection is done; the last one shuts it down."""
    global _session, _users
    with _lock:
        if _session is None:
            return
        _users -= 1
        if _users > 0:
            return
        session, _session, _users = _session, None, 0
        # Not if the caller shut it down and connected again meanwhile: that one is theirs.
        if ray.is_initialized() and _session_id() == session:
            ray.shutdown()


_PHASES = {Step: Phase.STEP, Reset: Phase.RESET}


def _row_bytes(batch: Batch, num_envs: int) -> int | None:
    """Bytes of one env's results (``None`` when observations are not arrays)."""
    if isinstance(batch.observations, ObjectRows):
        return None
    leaves = [batch.observations, batch.rewards, batch.terminations, batch.truncations]
    total = 0
    while leaves:
        leaf = leaves.pop()
        if isinstance(leaf, dict):
            leaves.extend(leaf.values())
        elif isinstance(leaf, tuple):
            leaves.extend(leaf)
        else:
            total += leaf.nbytes
    return -(-total // num_envs)


class RayTransport:
    """One actor per worker; replies come back per actor, in order.

    An actor on this machine answers on its socket (waited on with ``poll``, like the process
    backend's pipes); any other through ``ray.wait`` on its calls' results.
    """

    shares_memory = True  # the pool writes actions to :attr:`batch` and reads results there

    def __init__(self, options: TransportOptions) -> None:
        extra = options.ray or {}
        self._options = options
        self._memory: PoolMemory | None = None
        if extra.get("shared_memory", True) and node_memory.available():
            self._memory = PoolMemory(
                options.observation_space, options.action_space, options.num_envs
            )
            self.batch = self._memory.batch
        else:
            self.batch = Batch.local(
                options.observation_space, options.action_space, options.num_envs
            )
        self._read_action = (
            make_reader(options.action_space, self.batch.actions)
            if is_array_space(options.action_space)
            else None
        )
        workers = len(options.assignment)
        self._actors: list[Any] = []
        self._nodes: list[str] = [""] * workers
        # Per worker: (result refs, command) of each call in flight, oldest first; the refs are
        # the pieces of one result (one ref unless the result travels in pieces).
        self._refs: list[deque[tuple[list[Any], Command]]] = [deque() for _ in range(workers)]
        # Same-machine workers: their socket, the call that serves it, and replies owed.
        self._conns: list[Connection | None] = [None] * workers
        self._serving: list[Any] = [None] * workers
        self._owed = [0] * workers
        self._poller = select.poll()
        self._pickled = PickledCommands()
        self._authkey = secrets.token_bytes(32)
        self._row_bytes = _row_bytes(self.batch, options.num_envs)
        self._closed = False
        self._connected = _connect(extra.get("address"), dict(extra.get("init_kwargs") or {}))
        self._pool_node: str | None
        try:
            self._pool_node = str(ray.get_runtime_context().get_node_id())
        except Exception:  # a Ray Client connection: this process is on no node of the cluster
            self._pool_node = None
        try:
            self._actor_cls = ray.remote(GroupActor)
            resources = dict(extra.get("worker_resources") or {})
            resources.setdefault("num_cpus", 0)
            if "placement_group" not in resources:
                resources.setdefault("scheduling_strategy", "SPREAD")
            self._resources = resources
            for worker in range(workers):
                self._actors.append(self._spawn(worker, {}))
            self._await_start(range(workers), {})
        except BaseException:
            self.close(1.0)
            raise

    def _spawn(self, worker: int, restarts: dict[int, int]) -> Any:
        return self._actor_cls.options(max_concurrency=1, max_restarts=0, **self._resources).remote(
            self._options, worker, restarts
        )

    def _start_call(self, worker: int) -> Any:
        where = self._memory.where if self._memory is not None else None
        return self._actors[worker].start.remote(where, self._pool_node, self._authkey)

    def _await_start(self, workers: Iterable[int], restarts: dict[int, int]) -> None:
        """Wait until each of ``workers`` has built its envs; raise the first failure.

        An actor that dies before it has built them (its worker process or its node died, say
        a node that Ray does not know dead yet) is replaced, up to ``START_ATTEMPTS`` times.
        """
        started = [(worker, self._start_call(worker)) for worker in workers]
        deadline = time.monotonic() + START_TIMEOUT
        for worker, ref in started:
            ids = tuple(self._options.assignment[worker])
            delay = START_BACKOFF
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    reply: Reply
                    address: str | None
                    reply, self._nodes[worker], address = ray.get(
                        ref, timeout=max(0.0, deadline - time.monotonic())
                    )
                    break
                except GetTimeoutError as exc:
                    raise WorkerDiedError(
                        f"ray actor {worker} (envs {list(ids)}) did not start within "
                        f"{START_TIMEOUT:g}s: is there a node with the resources it asks for "
                        f"({self._resources})?",
                        env_index=None,
                        phase=Phase.MAKE,
                        worker=worker,
                        env_ids=ids,
                    ) from exc
                except RayError as exc:
                    if attempt == START_ATTEMPTS:
                        raise WorkerDiedError(
                            f"ray actor {worker} died while building its envs {list(ids)} "
                            f"({attempt} actors in a row): {exc}",
                            env_index=None,
                            phase=Phase.MAKE,
                            worker=worker,
                            env_ids=ids,
                        ) from exc
                    time.sleep(delay)
                    delay *= 2
                    self._actors[worker] = self._spawn(worker, restarts)
                    ref = self._start_call(worker)
            if reply.failures:
                raise reply.failures[0].to_error(worker, self._options.spec.name)
            if address is not None:
                self._connect_socket(worker, address)

    def _connect_socket(self, worker: int, address: str) -> None:
        self._serving[worker] = self._actors[worker].serve.remote()
        try:
            conn = Client(address, family="AF_UNIX", authkey=self._authkey)
        except (OSError, EOFError) as exc:
            ids = tuple(self._options.assignment[worker])
            raise WorkerDiedError(
                f"ray actor {worker} (envs {list(ids)}) built its envs but its socket could "
                f"not be reached: {exc}",
                env_index=None,
                phase=Phase.MAKE,
                worker=worker,
                env_ids=ids,
            ) from exc
        self._conns[worker] = conn
        self._owed[worker] = 0
        self._poller.register(conn.fileno(), select.POLLIN)

    def node_ids(self) -> list[str]:
        """The Ray node each actor runs on."""
        return list(self._nodes)

    def same_machine(self) -> list[bool]:
        """Whether each actor is served over a socket (on this machine) or by Ray calls."""
        return [conn is not None for conn in self._conns]

    def submit(self, worker: int, command: Command) -> None:
        conn = self._conns[worker]
        if conn is not None:
            self._owed[worker] += 1
            try:
                conn.send_bytes(self._pickled.dumps(command))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass  # the actor is gone: its socket reports it on the next wait
            return
        if isinstance(command, Step) and command.actions is None and self._read_action:
            # The pool wrote the actions to the batch, which this actor does not see.
            read = self._read_action
            command = Step(command.env_ids, {i: read(i) for i in command.env_ids})
        actor = self._actors[worker]
        chunks = 1
        if command.delivers_envs and self._row_bytes is not None:
            size = len(command.env_ids) * self._row_bytes  # type: ignore[union-attr]
            chunks = -(-size // CHUNK_BYTES)
        if chunks > 1:
            refs = actor.run_chunked.options(num_returns=chunks).remote(command, chunks)
        else:
            refs = [actor.run.remote(command)]
        self._refs[worker].append((refs, command))

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        on_sockets = any(self._owed)
        on_calls = any(self._refs)
        if not on_calls:
            return self._wait_sockets(timeout) if on_sockets else []
        if not on_sockets:
            return self._wait_calls(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_ = MIXED_WAIT_SLICE
            if deadline is not None:
                slice_ = max(0.0, min(slice_, deadline - time.monotonic()))
            replies = self._wait_sockets(slice_) + self._wait_calls(0.0)
            if replies or (deadline is not None and time.monotonic() >= deadline):
                return replies

    def _wait_sockets(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        while True:
            try:
                events = self._poller.poll(ms)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
        ready = {fd for fd, _ in events}
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, conn in enumerate(self._conns):
            if conn is None or conn.fileno() not in ready:
                continue
            try:
                replies.append((worker, conn.recv()))  # one per wake-up, as in the process one
                self._owed[worker] -= 1
            except (EOFError, OSError):
                self._drop_socket(worker)
                replies.append((worker, WorkerLost(None, "ray actor exited (its socket closed)")))
        return replies

    def _drop_socket(self, worker: int) -> None:
        conn = self._conns[worker]
        if conn is None:
            return
        self._conns[worker] = None
        self._owed[worker] = 0
        try:
            self._poller.unregister(conn.fileno())
        except (KeyError, ValueError):
            pass
        conn.close()

    def _wait_calls(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        heads = [refs[0][0][-1] for refs in self._refs if refs]
        if not heads:
            return []
        ready, _ = ray.wait(heads, num_returns=1, timeout=timeout)
        if not ready:
            return []
        # Everything else already done comes too, without waiting.
        pending = [ref for refs in self._refs for pieces, _ in refs for ref in pieces]
        done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) | set(ready)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, refs in enumerate(self._refs):
            while refs and refs[0][0][-1] in done:  # the pieces of a result come together
                pieces, command = refs.popleft()
                try:
                    values = ray.get(pieces)
                    result = values[0] if len(values) == 1 else pickle.loads(b"".join(values))
                    replies.append((worker, _unpack(result)))
                except RayTaskError as exc:  # the actor lives but the call failed (a bug)
                    replies.append((worker, _task_failed(command, exc)))
                except RayError as exc:  # actor, worker process or node died; result lost
                    refs.clear()
                    replies.append((worker, WorkerLost(None, f"ray actor lost: {exc}")))
        return replies

    def kill(self, worker: int) -> None:
        try:
            ray.kill(self._actors[worker], no_restart=True)
        except Exception:
            pass  # already gone: wait() reports it lost all the same

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.kill(worker)
        self._drop_socket(worker)
        self._refs[worker].clear()
        self._actors[worker] = self._spawn(worker, restarts)
        self._await_start([worker], restarts)

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._actors and ray.is_initialized():
                self._close_actors(timeout)
        finally:
            self._actors = []
            for worker in range(len(self._conns)):
                self._drop_socket(worker)
            for refs in self._refs:
                refs.clear()
            if self._memory is not None:
                self._memory.close()
            if self._connected:
                self._connected = False
                _disconnect()

    def _close_actors(self, timeout: float) -> None:
        """Ask each actor to close its envs, wait up to ``timeout``, then kill them all."""
        closing = []
        for worker, actor in enumerate(self._actors):
            conn = self._conns[worker]
            if conn is not None:
                try:
                    conn.send(Close())
                except Exception:
                    pass
                continue
            try:
                closing.append(actor.run.remote(Close()))
            except Exception:
                pass
        # A socket actor's serve call returns once it has closed its envs (or it died).
        closing += [ref for conn, ref in zip(self._conns, self._serving, strict=True) if conn]
        try:
            if closing:
                ray.wait(closing, num_returns=len(closing), timeout=timeout)
        except Exception:
            pass  # a dead actor or node: killed below all the same
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass


def _task_failed(command: Command, exc: RayTaskError) -> Reply:
    """The reply to a call the actor could not run: every env it named failed."""
    phase = _PHASES.get(type(command), Phase.CALL)
    if command.delivers_envs:
        ids: tuple[int, ...] = command.env_ids  # type: ignore[union-attr]
        return Reply(env_ids=ids, failures=tuple(EnvFailure.capture(i, phase, exc) for i in ids))
    return Reply(failures=(EnvFailure.capture(None, phase, exc),))


def open_transport(options: TransportOptions) -> RayTransport:
    return RayTransport(options)
