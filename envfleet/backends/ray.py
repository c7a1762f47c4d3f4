"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). Results larger than Ray returns
inline (images) travel in pieces that it does (the actor's side is in
:mod:`~envfleet.backends.ray_actor`). A dead actor or
node surfaces as a :class:`~envfleet.backends.base.WorkerLost`, like a dead process; an actor
that dies before it has built its envs (placed on a node that just died) is replaced.

Actors on the pool's own machine skip Ray's per-call path altogether: the batch arrays live in
memory they map too (:mod:`~envfleet.backends.node_memory`) and commands and replies go over a
Unix socket, through the loop the process backend's workers run
(:func:`~envfleet.backends.channel.serve_connection`). Ray then only places, starts, watches
and kills them; on one machine that makes the ray backend about as fast as the process backend.
Actors on other machines get each command as a Ray call, their actions carried in it.

Connections: a pool joins the Ray this process is already connected to, and then leaves it
alone. Otherwise it calls ``ray.init`` itself (with no address, a new private local Ray sized
for this machine, ``address="local"``, never a cluster that happens to run on the machine; or
the cluster at ``address``, ``"auto"`` included), and the last pool on that connection to
close calls ``ray.shutdown``: that stops a Ray envfleet started, and only disconnects from a
cluster it joined (which keeps running).

Ray is an optional extra (``pip install envfleet[ray]``): only this module and its actor's
(:mod:`~envfleet.backends.ray_actor`) import it.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import secrets
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import ray
import ray._private.ray_constants as ray_constants
import ray._private.worker as ray_worker
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from envfleet.backends import node_memory
from envfleet.backends.base import BaseTransport, TransportOptions, WorkerLost
from envfleet.backends.channel import PickledCommands, connect_pool
from envfleet.backends.node_memory import PoolMemory
from envfleet.backends.ray_actor import GroupActor, unpack
from envfleet.backends.ray_options import RayOptions
from envfleet.backends.rows import deliver
from envfleet.buffers import Batch, ObjectRows, is_array_space, make_reader
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Close, Command, EnvCommand, EnvFailure, Reply, Step

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An actor that dies before it has built its envs is replaced, up to this many actors in all,
``START_BACKOFF`` seconds later and twice as long each time (about 8 s in all)."""

CHUNK_BYTES = 90 * 1024
"""Results of a step or reset expected to be larger travel in pieces of about this size (under
Ray's 100 KiB limit for results returned inline), see
:meth:`~envfleet.backends.ray_actor.GroupActor.run_chunked`."""

MIXED_WAIT_SLICE = 0.001
"""With commands in flight both on same-machine actors (sockets) and on others (Ray calls), the
pool waits on each kind in turn this many seconds at a time."""

_lock = threading.Lock()
_session: str | None = None  # the Ray connection envfleet made (see _session_id), if any
_users = 0  # open transports on that connection
_reaper: subprocess.Popen[bytes] | None = None  # ends the Ray envfleet started if we are killed

SOCKET_DIR_PREFIX = "envfleet-ray-"
"""A pool's socket directory in the temp dir is ``envfleet-ray-<pid of its process>-<random>``:
the reaper, or a later pool, removes those of a process that is gone."""

REAPER = """
import glob, os, shutil, sys, time, psutil
owner, me, seen = psutil.Process(int(sys.argv[1])), psutil.Process(), {}
def ray_process(p):
    name = p.name()
    return name in ("gcs_server", "raylet") or name.startswith("ray::") or any(
        "/ray/" in part for part in p.cmdline())
while True:
    try:
        if not owner.is_running():
            break
        for child in owner.children(recursive=True):
            if child.pid != me.pid and child.pid not in seen and ray_process(child):
                seen[child.pid] = child
    except psutil.NoSuchProcess:
        break
    except psutil.Error:
        pass
    time.sleep(0.5)
for child in seen.values():
    try:
        child.kill()
    except psutil.Error:
        pass
for directory in glob.glob(sys.argv[2] + "*"):
    shutil.rmtree(directory, ignore_errors=True)
"""
"""The reaper: a process of its own that notes the Ray processes envfleet's process started
and kills them once that process is gone. When the pool's process is killed (SIGKILL: no
``close()``), Ray's own fate sharing stops ``gcs_server`` and the ``raylet``, but its agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) and idle workers were seen running 30 s
later; the reaper ends them within about a second, and removes the pools' socket
directories."""


def _start_reaper() -> None:
    global _reaper
    try:
        _reaper = subprocess.Popen(
            [sys.executable, "-c", REAPER, str(os.getpid()), _socket_dir_prefix(os.getpid())],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not stopped by the Ctrl-C that stops the pool
        )
    except OSError:
        _reaper = None  # Ray's own fate sharing still stops its main daemons


def _stop_reaper() -> None:
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is not None:
        reaper.kill()
        reaper.wait()


def _socket_dir_prefix(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{SOCKET_DIR_PREFIX}{pid}-")


def _make_socket_dir() -> str:
    """A new socket directory for this process's pool (mode 0700), after removing those of
    pools whose process is gone (killed: no ``close()``, and no reaper when the Ray was not
    envfleet's own)."""
    temp = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(temp) if name.startswith(SOCKET_DIR_PREFIX)]
    except OSError:
        names = []
    for name in names:
        pid = name[len(SOCKET_DIR_PREFIX) :].partition("-")[0]
        path = os.path.join(temp, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its pool's process is gone (a live pid is never swept)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # not ours to signal, or gone meanwhile
            continue
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")


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
        # No address: a private local Ray. A bare ray.init() would join whatever cluster was
        # last started on this machine (RAY_ADDRESS, or Ray's record of its latest cluster),
        # whose workers may run another Python than this one.
        if kwargs.get("address") is None:  # ray_init_kwargs={"address": None} included
            kwargs["address"] = "local"
        if not str(kwargs.get("address") or "").startswith("ray://"):  # Ray Client takes few
            kwargs = {"include_dashboard": False, "log_to_driver": False, **kwargs}
        private = kwargs.get("address") == "local"  # a Ray of our own, on this machine
        with loopback() if private and "_node_ip_address" not in kwargs else nullcontext():
            ray.init(**kwargs)
        _session, _users = _session_id(), 1
        if private:
            _start_reaper()
        return True


@contextmanager
def loopback() -> Iterator[None]:
    """Ray nodes started in this block listen on the loopback address only (``127.0.0.1``).

    Ray binds a node to the machine's external address, and some of its servers to every
    interface, even when asked for ``_node_ip_address="127.0.0.1"`` (it resolves that to the
    external address on Linux). It keeps a node on loopback only where multi-node clusters are
    off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read once at import): that switch is turned
    off while the private Ray starts, and put back. A private Ray serves this process alone, so
    nothing of it need be reachable from elsewhere. Ray versions without the switch are left
    as they are.
    """
    constants = ray_constants
    before = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if not isinstance(before, bool):
        yield
        return
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before


def describe_cluster() -> str:
    """The Ray this process is connected to, in words: its address, live nodes and CPUs."""
    try:
        nodes = len([node for node in ray.nodes() if node.get("Alive")])  # type: ignore[no-untyped-call]
        cpus = float(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]
    except Exception as exc:  # a Ray Client connection may not say
        return f"the Ray cluster at {_session_id()} (its nodes unknown: {exc})"
    return (
        f"the Ray cluster at {_session_id()}: {nodes} node{'s' * (nodes != 1)}, "
        f"{cpus:g} CPU{'s' * (cpus != 1)}"
    )


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
        _stop_reaper()


def _leave_ray_alone() -> None:
    """In a forked child of a process connected to Ray: exit without Ray's teardown.

    Ray's exit handler (``ray.shutdown``) would join threads that fork did not copy (a hang,
    then a Ray fatal error), and its gRPC objects, freed as the interpreter finalises or by the
    C++ core worker's own ``atexit`` handler, crash or wait 5 s on a connection that belongs to
    the parent. The child drops the Python handler, keeps those objects from being freed, and
    asks glibc to end the process with ``_exit(status)`` once Python has finalised, before the
    C++ handlers registered earlier run (``on_exit`` handlers run last-registered first and get
    the exit status as first argument, which ``_exit`` takes). The parent's Ray is untouched.
    """
    import ctypes

    import ray._private.state as ray_state

    atexit.unregister(ray_worker.shutdown)
    for obj in (ray_worker.global_worker, ray_state.state, ray_worker._global_node):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    try:
        libc = ctypes.CDLL(None)
        libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
    except (OSError, AttributeError):  # not glibc: the C++ handler may still wait its 5 s
        pass


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
        self._connected = _connect(extra.address, dict(extra.ray_init_kwargs))
        try:
            if extra.ray_shared_memory and node_memory.available():
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
        self._actors: list[Any] = []
        self._nodes: list[str] = [""] * workers
        self._pids: list[int | None] = [None] * workers  # each actor's process
        # Per worker: (result refs, command) of each call in flight, oldest first; the refs are
        # the pieces of one result (one ref unless the result travels in pieces).
        self._refs: list[deque[tuple[list[Any], Command]]] = [deque() for _ in range(workers)]
        # Same-machine workers: their socket, the call that serves it, and replies owed.
        self._conns: list[Connection | None] = [None] * workers
        # Per same-machine worker: its socket (to send without blocking) and the bytes of
        # commands it had no room for yet, written as it drains, within wait(): a large
        # command to an actor hung in a step cannot hold the pool up past step_timeout.
        self._socks: list[socket.socket | None] = [None] * workers
        self._outbox = [bytearray() for _ in range(workers)]
        self._serving: list[Any] = [None] * workers
        self._owed = [0] * workers
        self._poller = select.poll()
        self._pickled = PickledCommands()
        self._authkey = secrets.token_bytes(32)
        # The actors on this machine put their sockets in this directory (mode 0700: only this
        # user enters), which close() removes: an actor killed before the pool connected to it
        # leaves nothing behind.
        self._socket_dir = _make_socket_dir() if self._memory is not None else None
        self._row_bytes = _row_bytes(self.batch, options.num_envs)
        self._space = options.observation_space
        self._closed = False
        self._pool_node: str | None
        try:
            self._pool_node = str(ray.get_runtime_context().get_node_id())
        except Exception:  # a Ray Client connection: this process is on no node of the cluster
            self._pool_node = None
        try:
            self._actor_cls = ray.remote(GroupActor)
            resources = dict(extra.worker_resources)
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
        return self._actors[worker].start.remote(
            where, self._pool_node, self._authkey, self._socket_dir
        )

    def _await_start(self, workers: Iterable[int], restarts: dict[int, int]) -> None:
        """Wait until each of ``workers`` has built its envs; raise the first failure.

        An actor that dies before it has built them (its worker process or its node died, say
        a node that Ray does not know dead yet) is replaced, up to ``START_ATTEMPTS`` times.
        """
        started = [(worker, self._start_call(worker)) for worker in workers]
        timeout = self._options.start_timeout  # placing the actor and building its envs
        deadline = time.monotonic() + timeout
        for worker, ref in started:
            delay = START_BACKOFF
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    reply: Reply
                    address: str | None
                    reply, self._nodes[worker], address, self._pids[worker] = ray.get(
                        ref, timeout=max(0.0, deadline - time.monotonic())
                    )
                    break
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
                    if attempt == START_ATTEMPTS:
                        raise self._start_failed(
                            worker, f"died while building them ({attempt} actors in a row): {exc}"
                        ) from exc
                    time.sleep(delay)
                    delay *= 2
                    self._actors[worker] = self._spawn(worker, restarts)
                    ref = self._start_call(worker)
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
        self._serving[worker] = self._actors[worker].serve.remote()
        try:
            conn = connect_pool(address, self._authkey)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise self._start_failed(
                worker, f"built them but its socket could not be reached: {exc}"
            ) from exc
        self._conns[worker] = conn
        self._socks[worker] = socket.socket(fileno=conn.fileno())  # detached when dropped
        self._owed[worker] = 0
        self._poller.register(conn.fileno(), select.POLLIN)

    def memory(self, worker: int) -> int | None:
        """Resident memory of ``worker``'s actor process in bytes; ``None``: unknown (gone, or
        on another node, whose processes this one cannot read)."""
        pid = self._pids[worker]
        if pid is None or self._pool_node is None or self._nodes[worker] != self._pool_node:
            return None
        import psutil  # only worker_memory_limit asks

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except (psutil.Error, ValueError):
            return None

    def node_ids(self) -> list[str]:
        """The Ray node each actor runs on."""
        return list(self._nodes)

    def same_machine(self) -> list[bool]:
        """Whether each actor is served over a socket (on this machine) or by Ray calls."""
        return [conn is not None for conn in self._conns]

    def prepare(self, worker: int, command: Command) -> None:
        """Serialise ``command`` now: what cannot travel fails before anything changes."""
        if self._conns[worker] is not None:
            self._pickled.dumps(command)  # kept for submit
        else:
            cloudpickle.dumps(command)  # as Ray will, in submit

    def submit(self, worker: int, command: Command) -> None:
        sock = self._socks[worker]
        if sock is not None:
            self._owed[worker] += 1
            self._send(worker, sock, _message(self._pickled.dumps(command)))
            return
        if isinstance(command, Step) and command.actions is None and self._read_action:
            # The pool wrote the actions to the batch, which this actor does not see.
            read = self._read_action
            command = Step(command.env_ids, {i: read(i) for i in command.env_ids})
        actor = self._actors[worker]
        chunks = 1
        if isinstance(command, EnvCommand) and self._row_bytes is not None:
            size = len(command.env_ids) * self._row_bytes
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
        ready = {fd for fd, mask in events if mask != select.POLLOUT}
        if any(self._outbox):
            writable = {fd for fd, mask in events if mask & select.POLLOUT}
            for worker, conn in enumerate(self._conns):
                if conn is not None and self._outbox[worker] and conn.fileno() in writable:
                    self._flush(worker)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, conn in enumerate(self._conns):
            if conn is None or conn.fileno() not in ready:
                continue
            try:
                reply = conn.recv()  # one per wake-up, as in the process one
                if reply is not None and reply.rows is not None:
                    deliver(self.batch, self._space, reply)
                replies.append((worker, reply))
                self._owed[worker] -= 1
            except (EOFError, OSError):
                self._drop_socket(worker)
                replies.append((worker, WorkerLost(None, "ray actor exited (its socket closed)")))
        return replies

    def _send(self, worker: int, sock: socket.socket, message: bytes) -> None:
        """Send ``message`` (framed as ``Connection.send_bytes`` does) without blocking: what
        the socket has no room for waits in the worker's outbox."""
        outbox = self._outbox[worker]
        if outbox:  # earlier bytes still wait for room: these go after them
            outbox += message
            return
        try:
            sent = sock.send(message, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # the actor is gone: its socket reports it on the next wait
        if sent < len(message):
            outbox += message[sent:]
            self._poller.modify(sock.fileno(), select.POLLIN | select.POLLOUT)

    def _flush(self, worker: int) -> None:
        """Send what ``worker``'s outbox holds, as far as its socket has room."""
        sock, outbox = self._socks[worker], self._outbox[worker]
        if sock is None:
            outbox.clear()
            return
        try:
            while outbox:
                del outbox[: sock.send(outbox, socket.MSG_DONTWAIT)]
        except BlockingIOError:
            return
        except OSError:  # the actor is gone: its socket reports it
            outbox.clear()
        self._poller.modify(sock.fileno(), select.POLLIN)

    def _drop_socket(self, worker: int) -> None:
        conn = self._conns[worker]
        if conn is None:
            return
        self._conns[worker] = None
        self._outbox[worker].clear()
        sock, self._socks[worker] = self._socks[worker], None
        if sock is not None:
            sock.detach()  # the connection owns the descriptor
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
        global _session, _users, _reaper
        _session, _users, _reaper = None, 0, None
        self._closed = True
        _leave_ray_alone()

    def kill(self, worker: int) -> None:
        try:
            ray.kill(self._actors[worker], no_restart=True)
        except Exception:
            pass  # already gone: wait() reports it lost all the same

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.kill(worker)
        self._pids[worker] = None
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
            socket_dir = getattr(self, "_socket_dir", None)
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
            self._disconnect()

    def _disconnect(self) -> None:
        if self._connected:
            self._connected = False
            _disconnect()

    def _close_actors(self, timeout: float) -> None:
        """Ask each actor to close its envs, wait up to ``timeout``, then kill them all."""
        closing = []
        for worker, actor in enumerate(self._actors):
            sock = self._socks[worker]
            if sock is not None:
                self._flush(worker)
                # Without blocking: an actor that cannot take it is killed below all the same.
                self._send(worker, sock, _message(self._pickled.dumps(Close())))
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
        finally:  # a Ctrl-C in the wait too
            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass


def _message(data: bytes) -> bytes:
    """``data`` framed as ``multiprocessing.connection.Connection.send_bytes`` frames it (the
    actor reads it with ``recv``)."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(data)) + data
    return struct.pack("!i", len(data)) + data


def _task_failed(command: Command, exc: RayTaskError) -> Reply:
    """The reply to a call the actor could not run: every env it named failed."""
    phase = command.phase
    if isinstance(command, EnvCommand):
        ids = command.env_ids
        return Reply(env_ids=ids, failures=tuple(EnvFailure.capture(i, phase, exc) for i in ids))
    return Reply(failures=(EnvFailure.capture(None, phase, exc),))


def open_transport(options: TransportOptions) -> Any:
    extra = options.backend_options
    if isinstance(extra, RayOptions) and extra.nodes is not None:
        from envfleet.backends.nodes import NodeTransport  # one sub-pool per node

        return NodeTransport(options)
    return RayTransport(options)
