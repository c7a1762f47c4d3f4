"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). Results larger than Ray returns
inline (images) travel in pieces that it does (this call path is
:mod:`~envfleet.backends.ray.call_path`; the actor's side is
:mod:`~envfleet.backends.ray.actor`). A dead actor or node surfaces as a
:class:`~envfleet.backends.contract.base.WorkerLost`, like a dead process; an actor that dies
before it has built its envs (placed on a node that just died) is replaced.

Actors on the pool's own machine skip Ray's per-call path altogether: the batch arrays live in
memory they map too (:mod:`~envfleet.backends.ray.memory`) and commands and replies go over a
Unix socket, through the loop the process backend's workers run
(:func:`~envfleet.backends.contract.channel.serve_connection`; this socket path is
:mod:`~envfleet.backends.ray.socket_path`). Ray then only places, starts,
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
import secrets
import shutil
import time
from collections.abc import Iterable
from multiprocessing import AuthenticationError
from typing import Any

import cloudpickle
import psutil
import ray
from ray.exceptions import GetTimeoutError, RayError

from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    TransportOptions,
    WorkerLost,
)
from envfleet.backends.contract.replies import PickledCommands
from envfleet.backends.contract.rows import pack, row_bytes
from envfleet.backends.ray import memory as node_memory
from envfleet.backends.ray import reaper as ray_reaper
from envfleet.backends.ray import session as ray_session
from envfleet.backends.ray.actor import GroupActor
from envfleet.backends.ray.call_path import submit_call, wait_calls
from envfleet.backends.ray.memory import PoolMemory
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.socket_path import ActorSockets
from envfleet.backends.ray.worker_actor import ActorSlot, close_actors, message
from envfleet.buffers import Batch, is_array_space
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Close, Command, Reply, Rows
from envfleet.row_access import make_reader

__all__ = ["MIXED_WAIT_SLICE", "RayTransport", "open_transport"]

MIXED_WAIT_SLICE = 0.001
"""With commands in flight both on same-machine actors (sockets) and on others (Ray calls), the
pool waits on each kind in turn this many seconds at a time."""


class RayTransport(BaseTransport, BaseWorkers):
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
        self._pickled = PickledCommands()
        self._authkey = secrets.token_bytes(32)
        self._sockets = ActorSockets(
            self._workers, self._authkey, self.batch, options.observation_space
        )
        # The actors on this machine put their sockets in this directory (mode 0700: only this
        # user enters), which close() removes: an actor killed before the pool connected to it
        # leaves nothing behind.
        self._socket_dir = ray_reaper.make_socket_dir() if self._memory is not None else None
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

    def _spawn(self, worker: int, restarts: dict[int, int], rows: Rows | None = None) -> Any:
        return self._actor_cls.options(max_concurrency=1, max_restarts=0, **self._resources).remote(
            self._options, worker, restarts, rows
        )

    def _respawn(self, worker: int, restarts: dict[int, int], rows: Rows | None) -> Any:
        """A new actor for ``worker`` (the last one died starting); its start call's ref."""
        self._workers[worker].handle = self._spawn(worker, restarts, rows)
        return self._start_call(worker)

    def _rows(self, worker: int) -> Rows | None:
        """``worker``'s envs' rows as the pool holds them (observations, rewards, flags), for
        an actor that replaces it: one on another machine starts from them, where its own
        arrays would start at zero (one on this machine maps them). A restarted env's
        truncation keeps its latest observation (a rollout's first row), as on one machine."""
        ids = tuple(self._options.assignment[worker])
        return pack(self.batch, self._space, Reply(env_ids=ids), results=True)

    def _start_call(self, worker: int) -> Any:
        where = self._memory.where if self._memory is not None else None
        return self._workers[worker].handle.start.remote(
            where, self._pool_node, self._authkey, self._socket_dir
        )

    def _await_start(
        self, workers: Iterable[int], restarts: dict[int, int], rows: Rows | None = None
    ) -> None:
        """Wait until each of ``workers`` has built its envs; raise the first failure. An actor
        that dies first (its node died) is replaced (:func:`ray_session.await_start`), with
        the same ``restarts`` and ``rows``."""
        started = [(worker, self._start_call(worker)) for worker in workers]
        timeout = self._options.start_timeout  # placing the actor and building its envs
        deadline = time.monotonic() + timeout
        for worker, ref in started:
            slot = self._workers[worker]
            try:
                reply: Reply
                address: str | None
                reply, slot.node, address, slot.pid = ray_session.await_start(
                    ref, deadline, functools.partial(self._respawn, worker, restarts, rows)
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
        try:
            self._sockets.connect(worker, address)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise self._start_failed(
                worker, f"built them but its socket could not be reached: {exc}"
            ) from exc

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
        return bool(self._sockets.writing) or any(slot.refs for slot in self._workers)

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
        submit_call(slot, command, self._read_action, self._row_bytes)

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        on_sockets = any(slot.owed for slot in self._workers)
        on_calls = any(slot.refs for slot in self._workers)
        if not on_calls:
            return self._sockets.wait(timeout) if on_sockets else []
        if not on_sockets:
            return wait_calls(self._workers, timeout, self.batch, self._space)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_ = MIXED_WAIT_SLICE
            if deadline is not None:
                slice_ = max(0.0, min(slice_, deadline - time.monotonic()))
            replies = self._sockets.wait(slice_)
            replies += wait_calls(self._workers, 0.0, self.batch, self._space)
            if replies or (deadline is not None and time.monotonic() >= deadline):
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
        self._sockets.drop(worker)
        slot.refs.clear()
        rows = self._rows(worker)
        slot.handle = self._spawn(worker, restarts, rows)
        self._await_start([worker], restarts, rows)

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
                self._sockets.drop(worker)
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


def open_transport(options: TransportOptions) -> RayTransport:
    """One actor per worker, whatever the cluster (the ``ray`` backend chooses between this and
    node sub-pools: :mod:`envfleet.backends.ray_backend`)."""
    return RayTransport(options)
