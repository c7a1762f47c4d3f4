"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). Results larger than Ray returns
inline (images) travel in pieces that it does (the actor's side is
:mod:`~envfleet.backends.ray.actor`). A dead actor or node surfaces as a
:class:`~envfleet.backends.contract.base.WorkerLost`, like a dead process; an actor that dies
before it has built its envs (placed on a node that just died) is replaced.

Actors on the pool's own machine skip Ray's per-call path altogether: the batch arrays live in
memory they map too (:mod:`~envfleet.backends.ray.memory`) and commands and replies go over a
Unix socket, through the loop the process backend's workers run
(:func:`~envfleet.backends.contract.channel.serve_connection`). Ray then only places, starts,
watches and kills them; on one machine that makes the ray backend about as fast as the process
backend. Actors on other machines get each command as a Ray call, their actions carried in it.
A pool on a cluster runs one sub-pool per node instead (:mod:`envfleet.backends.nodes`, as
:mod:`envfleet.backends.ray_backend` chooses), unless it talks to Ray through a Ray Client
connection (``ray://``): its process is then on no node, can reach neither the agents' sockets
nor a node's memory, and every actor takes its commands as Ray calls.

Which Ray a pool runs on, and when that Ray is let go of, is
:mod:`~envfleet.backends.ray.session`'s business. Ray is an optional extra (``pip install
envfleet[ray]``): only the backends' Ray modules import it.
"""

from __future__ import annotations

import functools
import math
import pickle
import secrets
import select
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from multiprocessing import AuthenticationError
from typing import Any

import cloudpickle
import psutil
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from envfleet.backends.contract.base import BaseTransport, TransportOptions, WorkerLost
from envfleet.backends.contract.connections import connect_pool
from envfleet.backends.contract.outbox import Outbox
from envfleet.backends.contract.replies import PickledCommands
from envfleet.backends.contract.rows import deliver, row_bytes
from envfleet.backends.ray import memory as node_memory
from envfleet.backends.ray import session as ray_session
from envfleet.backends.ray.actor import GroupActor, unpack
from envfleet.backends.ray.memory import PoolMemory
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.worker_actor import ActorSlot, close_actors, message
from envfleet.buffers import Batch, is_array_space, make_reader
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Close, Command, EnvCommand, EnvFailure, Reply, Step

CHUNK_BYTES = 90 * 1024
"""Results of a step or reset expected to be larger travel in pieces of about this size (under
Ray's 100 KiB limit for results returned inline), see
:meth:`~envfleet.backends.ray.actor.GroupActor.run_chunked`."""

MIXED_WAIT_SLICE = 0.001
"""With commands in flight both on same-machine actors (sockets) and on others (Ray calls), the
pool waits on each kind in turn this many seconds at a time."""


class RayTransport(BaseTransport):
    """One actor per worker; replies come back per actor, in order.

    An actor on this machine answers on its socket (waited on with ``poll``, like the process
    backend's pipes); any other through ``ray.wait`` on its calls' results.
    """

    def __init__(self, options: TransportOptions) -> None:
        extra = options.backend_options
        if not isinstance(extra, RayOptions):
            extra = RayOptions()
        self._options = options
        self._memory: PoolMemory | None = None
        self._connected = ray_session.connect(
            extra.address, dict(extra.ray_init_kwargs), extra.connect_timeout
        )
        # Over a Ray Client connection (ray://) this process is on no node: no actor shares
        # its memory, every command is a Ray call.
        self._pool_node = ray_session.pool_node()
        try:
            if extra.ray_shared_memory and node_memory.available() and self._pool_node is not None:
                self._memory = PoolMemory(
                    options.observation_space, options.action_space, options.num_envs
                )
        except BaseException:
            self._disconnect()
            raise
        self.batch = (
            self._memory.batch
            if self._memory is not None
            else Batch.local(options.observation_space, options.action_space, options.num_envs)
        )
        self._read_action = (
            make_reader(options.action_space, self.batch.actions)
            if is_array_space(options.action_space)
            else None
        )
        workers = len(options.assignment)
        self._workers = [ActorSlot() for _ in range(workers)]
        self._writing: set[int] = set()  # workers whose outbox holds bytes
        self._poller = select.poll()
        self._pickled = PickledCommands()
        self._authkey = secrets.token_bytes(32)
        # The actors on this machine put their sockets in this directory (mode 0700: only this
        # user enters), which close() removes: an actor killed before the pool connected to it
        # leaves nothing behind.
        self._socket_dir = ray_session.make_socket_dir() if self._memory is not None else None
        self._row_bytes = row_bytes(self.batch, options.num_envs)
        self._space = options.observation_space
        self._closed = False
        try:
            self._actor_cls = ray.remote(GroupActor)
            resources = dict(extra.worker_resources)
            resources.setdefault("num_cpus", 0)
            if "placement_group" not in resources:
                resources.setdefault("scheduling_strategy", "SPREAD")
            self._resources = resources
            for worker in range(workers):
                self._workers[worker].handle = self._spawn(worker, {})
            self._await_start(range(workers), {})
        except BaseException:
            self.close(1.0)
            raise

    def _spawn(self, worker: int, restarts: dict[int, int]) -> Any:
        return self._actor_cls.options(max_concurrency=1, max_restarts=0, **self._resources).remote(
            self._options, worker, restarts
        )

    def _respawn(self, worker: int, restarts: dict[int, int]) -> Any:
        """A new actor for ``worker`` (the last one died starting); its start call's ref."""
        self._workers[worker].handle = self._spawn(worker, restarts)
        return self._start_call(worker)

    def _start_call(self, worker: int) -> Any:
        where = self._memory.where if self._memory is not None else None
        return self._workers[worker].handle.start.remote(
            where, self._pool_node, self._authkey, self._socket_dir
        )

    def _await_start(self, workers: Iterable[int], restarts: dict[int, int]) -> None:
        """Wait until each of ``workers`` has built its envs; raise the first failure. An actor
        that dies first (its node died) is replaced (:func:`ray_session.await_start`)."""
        started = [(worker, self._start_call(worker)) for worker in workers]
        timeout = self._options.start_timeout  # placing the actor and building its envs
        deadline = time.monotonic() + timeout
        for worker, ref in started:
            slot = self._workers[worker]
            try:
                reply: Reply
                address: str | None
                reply, slot.node, address, slot.pid = ray_session.await_start(
                    ref, deadline, functools.partial(self._respawn, worker, restarts)
                )
                slot.process = self._local_process(slot)
            except GetTimeoutError as exc:
                self.kill(worker)
                raise self._start_failed(
                    worker,
                    f"did not start within start_timeout={timeout:g}s: its envs' "
                    "constructor hangs, or no node has the resources it asks for "
                    f"({self._resources})",
                    EnvTimeoutError,
                ) from exc
            except RayError as exc:
                attempts = ray_session.START_ATTEMPTS
                raise self._start_failed(
                    worker, f"died while building them ({attempts} actors in a row): {exc}"
                ) from exc
            if reply.failures:
                raise reply.failures[0].to_error(worker, self._options.spec.name)
            if address is not None:
                self._connect_socket(worker, address)

    def _start_failed(
        self, worker: int, why: str, kind: type[WorkerDiedError] = WorkerDiedError
    ) -> WorkerDiedError:
        ids = tuple(self._options.assignment[worker])
        return kind(
            f"worker {worker} (a ray actor, envs {list(ids)}) {why}",
            env_index=None,
            phase=Phase.MAKE,
            worker=worker,
            env_ids=ids,
        )

    def _connect_socket(self, worker: int, address: str) -> None:
        slot = self._workers[worker]
        slot.serving = slot.handle.serve.remote()
        try:
            conn = connect_pool(address, self._authkey)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise self._start_failed(
                worker, f"built them but its socket could not be reached: {exc}"
            ) from exc
        sock = socket.socket(fileno=conn.fileno())  # detached when dropped
        fd = conn.fileno()
        slot.conn, slot.sock, slot.owed = conn, sock, 0
        slot.outbox = Outbox(
            lambda data: sock.send(data, socket.MSG_DONTWAIT), self._watcher(worker, fd)
        )
        self._poller.register(fd, select.POLLIN)

    def _watcher(self, worker: int, fd: int) -> Callable[[bool], None]:
        """What ``worker``'s outbox calls when bytes start or stop waiting in it."""

        def watch(waiting: bool) -> None:
            if waiting:
                self._writing.add(worker)
                self._poller.modify(fd, select.POLLIN | select.POLLOUT)
            elif worker in self._writing:
                self._writing.discard(worker)
                self._poller.modify(fd, select.POLLIN)

        return watch

    def memory(self, worker: int) -> int | None:
        """Resident memory of ``worker``'s actor process in bytes; ``None``: unknown (gone, or
        on another node, whose processes this one cannot read)."""
        process = self._workers[worker].process
        if process is None:
            return None
        try:
            return int(process.memory_info().rss)
        except psutil.Error:
            return None

    def node_ids(self) -> list[str]:
        """The Ray node each actor runs on."""
        return [slot.node for slot in self._workers]

    def same_machine(self) -> list[bool]:
        """Whether each actor is served over a socket (on this machine) or by Ray calls."""
        return [slot.conn is not None for slot in self._workers]

    def sockets(self) -> list[int]:
        """The actors' sockets, for a pool that polls them with its own (driver_node.py)."""
        return [slot.conn.fileno() for slot in self._workers if slot.conn is not None]

    def busy(self) -> bool:
        """Whether a reply may come with no event on :meth:`sockets` (Ray calls, full sockets)."""
        return bool(self._writing) or any(slot.refs for slot in self._workers)

    def prepare(self, worker: int, command: Command) -> None:
        """Serialise ``command`` now: what cannot travel fails before anything changes."""
        if self._workers[worker].conn is not None:
            self._pickled.dumps(command)  # kept for submit
        else:
            cloudpickle.dumps(command)  # as Ray will, in submit

    def submit(self, worker: int, command: Command) -> None:
        slot = self._workers[worker]
        if slot.outbox is not None:
            slot.owed += 1
            slot.outbox.send(message(self._pickled.dumps(command)))
            return
        if isinstance(command, Step) and command.actions is None and self._read_action:
            # The pool wrote the actions to the batch, which this actor does not see.
            read = self._read_action
            command = Step(command.env_ids, {i: read(i) for i in command.env_ids})
        actor = slot.handle
        chunks = 1
        if isinstance(command, EnvCommand) and self._row_bytes is not None:
            size = len(command.env_ids) * self._row_bytes
            chunks = -(-size // CHUNK_BYTES)
        if chunks > 1:
            refs = actor.run_chunked.options(num_returns=chunks).remote(command, chunks)
        else:
            refs = [actor.run.remote(command)]
        slot.refs.append((refs, command))

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        on_sockets = any(slot.owed for slot in self._workers)
        on_calls = any(slot.refs for slot in self._workers)
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
        ready = {fd for fd, mask in events if mask != select.POLLOUT}
        workers = self._workers
        if self._writing:  # commands wait for room in their sockets
            writable = {fd for fd, mask in events if mask & select.POLLOUT}
            for worker in list(self._writing):
                slot = workers[worker]
                if slot.conn is not None and slot.outbox and slot.conn.fileno() in writable:
                    slot.outbox.flush()
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, slot in enumerate(workers):
            conn = slot.conn
            if conn is None or conn.fileno() not in ready:
                continue
            try:
                reply = conn.recv()  # one per wake-up, as in the process one
                if type(reply) is tuple:  # nothing but infos, as columns: into the table
                    self.batch.infos.put(reply)
                    reply = None
                elif reply is not None and reply.rows is not None:
                    deliver(self.batch, self._space, reply)
                replies.append((worker, reply))
                slot.owed -= 1
            except (EOFError, OSError):
                self._drop_socket(worker)
                replies.append((worker, WorkerLost(None, "ray actor exited (its socket closed)")))
        return replies

    def _drop_socket(self, worker: int) -> None:
        slot = self._workers[worker]
        conn = slot.conn
        if conn is None:
            return
        if slot.outbox is not None:
            slot.outbox.drop()
        sock = slot.sock
        slot.conn = slot.sock = slot.outbox = None
        if sock is not None:
            sock.detach()  # the connection owns the descriptor
        slot.owed = 0
        try:
            self._poller.unregister(conn.fileno())
        except (KeyError, ValueError):
            pass
        conn.close()

    def _wait_calls(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        workers = self._workers
        heads = [slot.refs[0][0][-1] for slot in workers if slot.refs]
        if not heads:
            return []
        ready, _ = ray.wait(heads, num_returns=1, timeout=timeout)
        if not ready:
            return []
        # Everything else already done comes too, without waiting.
        pending = [ref for slot in workers for pieces, _ in slot.refs for ref in pieces]
        done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) | set(ready)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, slot in enumerate(workers):
            refs = slot.refs
            while refs and refs[0][0][-1] in done:  # the pieces of a result come together
                pieces, command = refs.popleft()
                try:
                    values = ray.get(pieces)
                    result = values[0] if len(values) == 1 else pickle.loads(b"".join(values))
                    reply = unpack(result)  # the rows travelled back: into the batch
                    replies.append((worker, deliver(self.batch, self._space, reply)))
                except RayTaskError as exc:  # the actor lives but the call failed (a bug)
                    replies.append((worker, _task_failed(command, exc)))
                except RayError as exc:  # actor, worker process or node died; result lost
                    refs.clear()
                    replies.append((worker, WorkerLost(None, f"ray actor lost: {exc}")))
        return replies

    def forked(self) -> None:
        """In a forked child: the actors, the connection and the Ray are the parent's."""
        self._closed = True
        ray_session.forked()

    def _local_process(self, slot: ActorSlot) -> psutil.Process | None:
        """The process of ``slot``'s actor when it runs on the pool's machine."""
        if not slot.runs_on(self._pool_node):
            return None
        try:
            return psutil.Process(slot.pid)
        except (psutil.Error, ValueError):
            return None

    def kill(self, worker: int) -> None:
        slot = self._workers[worker]
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:
            pass  # already gone: wait() reports it lost all the same
        # Ray asks an actor to exit and kills it past a grace of seconds (5 s for one stopped
        # by SIGSTOP): on this machine its process, known since it started, ends at once
        # (psutil refuses a pid that another process has taken since).
        if slot.process is not None:
            try:
                slot.process.kill()
            except psutil.Error:
                pass

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.kill(worker)
        slot = self._workers[worker]
        slot.pid = slot.process = None
        self._drop_socket(worker)
        slot.refs.clear()
        slot.handle = self._spawn(worker, restarts)
        self._await_start([worker], restarts)

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if any(slot.handle is not None for slot in self._workers) and ray.is_initialized():
                self._close_actors(timeout)
        finally:
            for worker, slot in enumerate(self._workers):
                slot.handle = None
                self._drop_socket(worker)
                slot.refs.clear()
            if self._memory is not None:
                self._memory.close()
            socket_dir = getattr(self, "_socket_dir", None)
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
            self._disconnect()

    def _disconnect(self) -> None:
        if self._connected:
            self._connected = False
            ray_session.disconnect()

    def _close_actors(self, timeout: float) -> None:
        """Ask each actor to close its envs, wait up to ``timeout``, then kill them all (and
        see that those on this machine have ended)."""
        close_actors(self._workers, self._pickled.dumps(Close()), timeout)


def _task_failed(command: Command, exc: RayTaskError) -> Reply:
    """The reply to a call the actor could not run: every env it named failed."""
    phase = command.phase
    if isinstance(command, EnvCommand):
        ids = command.env_ids
        return Reply(env_ids=ids, failures=tuple(EnvFailure.capture(i, phase, exc) for i in ids))
    return Reply(failures=(EnvFailure.capture(None, phase, exc),))


def open_transport(options: TransportOptions) -> RayTransport:
    """One actor per worker, whatever the cluster (the ``ray`` backend chooses between this and
    node sub-pools: :mod:`envfleet.backends.ray_backend`)."""
    return RayTransport(options)


__all__ = ["CHUNK_BYTES", "MIXED_WAIT_SLICE", "RayTransport", "open_transport"]
