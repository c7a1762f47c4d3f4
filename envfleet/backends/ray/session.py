"""The ray backend's connection to Ray: joined or started, shared by its pools, let go of.

A pool joins the Ray this process is already connected to, and then leaves it alone. Otherwise
it calls ``ray.init`` itself (with no address, a new private local Ray sized for this machine,
``address="local"``, never a cluster that happens to run on the machine; or the cluster at
``address``, ``"auto"`` included), and the last pool on that connection to close calls
``ray.shutdown``: that stops a Ray envfleet started, and only disconnects from a cluster it
joined (which keeps running).

Joining a cluster is bounded (:func:`join`): a quick look at the address first (nothing
listening there fails in well under a second), then ``connect_timeout`` for the whole join, and
the caller's Ctrl-C is taken at once; past it, one :class:`ConnectionError` names the address,
says that no Ray answered there and how to start one. A Ray Client connection (``ray://``) runs
the pool's process on no node of the cluster (:func:`client_connected`, :func:`pool_node`).

A Ray of envfleet's own gets a reaper, which ends its processes should the pool's process be
killed; the pools' socket directories (actors on this machine) are named after their process,
so that the reaper, or a later pool, removes those left behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
import ray._private.worker as ray_worker
from ray.exceptions import GetTimeoutError, RayError

_lock = threading.Lock()
_session: str | None = None  # the Ray connection envfleet made (see _session_id), if any
_users = 0  # open transports on that connection
_reaper: subprocess.Popen[bytes] | None = None  # ends the Ray envfleet started if we are killed

CONNECT_TIMEOUT = 20.0
"""Seconds a join of a cluster may take in all (``RayOptions.connect_timeout``), see
:func:`join`."""

PROBE_TIMEOUT = 1.0
"""Seconds the first look at a cluster's address gives a TCP connection to open there."""

WAIT_SLICE = 0.1
"""The join waits in slices this long, so that a Ctrl-C stops it at once."""

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An actor that dies before it has started (placed on a node that just died, which Ray may not
know dead yet) is replaced, up to this many actors in all, ``START_BACKOFF`` seconds later and
twice as long each time (about 8 s in all), see :func:`await_start`."""

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
def owner_gone():
    try:
        return not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
while not owner_gone():
    try:
        children = owner.children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:  # a child gone, or a zombie (no cmdline), is no reason to stop the owner's Ray
            if child.pid != me.pid and child.pid not in seen and ray_process(child):
                seen[child.pid] = child
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
directories. Only the owner's own end counts: another of its children that ends (a forked
child, a subprocess: gone, or a zombie without a command line until it is reaped) used to be
taken for it, and the reaper killed the Ray of a process still using it."""


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


def make_socket_dir() -> str:
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


def await_start(ref: Any, deadline: float, replace: Callable[[], Any]) -> Any:
    """The value of an actor's start call ``ref``, by ``deadline`` (``time.monotonic()``).

    Should the actor die first, ``replace()`` starts another and returns its start call's ref,
    up to :data:`START_ATTEMPTS` actors in all, with a growing pause between them.

    Raises:
        GetTimeoutError: ``deadline`` passed.
        RayError: the last actor died too (the caller names the attempts,
            :data:`START_ATTEMPTS`).
    """
    delay = START_BACKOFF
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            raise
        except RayError:
            if attempt == START_ATTEMPTS:
                raise
            time.sleep(delay)
            delay *= 2
            ref = replace()
    raise AssertionError("unreachable")  # pragma: no cover


def client_connected() -> bool:
    """Whether this process talks to Ray through a Ray Client connection (``ray://``, made by
    envfleet or by the caller): its process is on no node of the cluster, and can reach neither
    the nodes' sockets nor their memory."""
    try:
        from ray.util.client import ray as client_ray

        return bool(client_ray.is_connected())  # type: ignore[no-untyped-call]
    except Exception:  # a Ray without its client
        return False


def pool_node() -> str | None:
    """The Ray node this process runs on; ``None`` over a Ray Client connection (on none: Ray
    answers with the node of the client server's process, which is not this one)."""
    if client_connected():
        return None
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None


def _session_id() -> str:
    """What identifies the Ray this process is connected to (its GCS address)."""
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection may not say
        return "connected"


def connect(
    address: str | None, init_kwargs: dict[str, Any], timeout: float = CONNECT_TIMEOUT
) -> bool:
    """Join this process's Ray, or connect it to one; True when envfleet owns the connection.

    Args:
        address: ``RayOptions.address``.
        init_kwargs: more keyword arguments for ``ray.init`` (``RayOptions.ray_init_kwargs``).
        timeout: seconds a join of a cluster may take (:func:`join`); a private local Ray is
            not bounded by it (Ray bounds its own start).

    Raises:
        ConnectionError: no Ray answered at the address, within ``timeout``.
    """
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
        if private:
            with loopback() if "_node_ip_address" not in kwargs else nullcontext():
                ray.init(**kwargs)
        else:
            join(str(kwargs["address"]), kwargs, timeout)
        _session, _users = _session_id(), 1
        if private:
            _start_reaper()
        return True


def no_ray(address: str, why: str) -> ConnectionError:
    """The one error of a join that found no Ray at ``address``: the address, why, the fix."""
    if address.startswith("ray://"):
        fix = (
            "start one with `ray start --head` (its Ray Client server listens on port 10001 "
            "unless --ray-client-server-port says otherwise)"
        )
    else:
        fix = "start one with `ray start --head`"
    return ConnectionError(
        f"no Ray answered at {address} ({why}): {fix} and give its address (or set "
        "RAY_ADDRESS and use the address 'auto'); or give no address for a private local Ray"
    )


def _endpoints(address: str) -> list[tuple[str, int]]:
    """Where ``address`` should have something listening (``host``, ``port``), as it was
    given and as Ray will dial it (a loopback host may stand for this machine's address); an
    empty list where that cannot be told beforehand (Ray then says what it finds).

    Raises:
        ConnectionError: ``"auto"``, and no Ray runs on this machine (nor in ``RAY_ADDRESS``).
    """
    from ray._private import services

    target = address.removeprefix("ray://")
    if address == "auto":
        if os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
            return []  # Ray reads it as a Ray Client address: left to Ray
        try:
            target = services.canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError as exc:
            text = " ".join(str(exc).split())
            if "multiple" in text.lower():  # several, none of them Ray's latest: which one?
                raise ConnectionError(
                    f"address='auto' found several Rays on this machine ({text}): give the "
                    "address of one, or set RAY_ADDRESS"
                ) from exc
            raise no_ray("auto", "none runs on this machine, and RAY_ADDRESS is not set") from exc
        except Exception:
            return []
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return []  # Ray's own error says what is wrong with it
    found = [(host, int(port))]
    if not address.startswith("ray://"):
        try:
            dialled = services.canonicalize_bootstrap_address(target)
        except Exception:
            dialled = None
        if dialled:
            other, _, other_port = dialled.rpartition(":")
            if other_port.isdigit() and (other.strip("[]"), int(other_port)) not in found:
                found.append((other.strip("[]"), int(other_port)))
    return found


def _listening(address: str, endpoints: list[tuple[str, int]], deadline: float) -> str:
    """The first of ``endpoints`` where a TCP connection opens, as ``host:port``.

    Raises:
        ConnectionError: none: a closed port answers at once, a silent host within
            :data:`PROBE_TIMEOUT`.
    """
    why: list[str] = []
    for host, port in endpoints:
        left = max(0.01, min(PROBE_TIMEOUT, deadline - time.monotonic()))
        try:
            socket.create_connection((host, port), timeout=left).close()
            return f"{host}:{port}"
        except TimeoutError:
            why.append(f"nothing answered at {host}:{port} within {left:g}s")
        except OSError as exc:
            why.append(f"{host}:{port}: {exc.strerror or exc}")
    raise no_ray(address, why[0])  # as the address was given


def _speaks_grpc(address: str, endpoint: str, deadline: float, timeout: float) -> None:
    """Wait until ``endpoint`` completes a gRPC handshake (Ray's servers speak gRPC), by
    ``deadline``, in slices (a Ctrl-C stops it at once). Not checked over TLS.

    Raises:
        ConnectionError: it did not, within ``timeout`` seconds.
    """
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return
    import grpc

    channel = grpc.insecure_channel(endpoint)
    try:
        ready = grpc.channel_ready_future(channel)
        while True:
            try:
                ready.result(timeout=max(0.0, min(WAIT_SLICE, deadline - time.monotonic())))
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() >= deadline:
                    ready.cancel()
                    raise no_ray(
                        address,
                        f"something listens at {endpoint}, but it did not answer as Ray's "
                        f"servers do within connect_timeout={timeout:g}s",
                    ) from None
    finally:
        channel.close()


_joining: threading.Thread | None = None  # a join given up on (timed out), still in ray.init


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """The SIGTERM handler ``ray.init`` sets when it runs in the main thread (:func:`join`
    runs it in another, and sets it itself)."""
    sys.exit(signum)


class _NotInTheMainThread(logging.Filter):
    """Drops ``ray.init``'s warning that it set no SIGTERM handler, outside the main thread:
    :func:`join` set it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


def join(address: str, kwargs: dict[str, Any], timeout: float) -> None:
    """``ray.init(**kwargs)`` to join the cluster at ``address``, within ``timeout`` seconds.

    First a look at the address (:func:`_endpoints`): nothing listening there fails at once,
    something that is not Ray within the timeout; then ``ray.init`` runs in a thread of its
    own, which the caller waits on in slices: past the timeout, or at a Ctrl-C, the caller
    gives up at once and that thread, once Ray lets it go, disconnects what it may still have
    connected. Ray's own errors of a failed join (a ``ConnectionError``, or the ``SystemExit``
    of a GCS it could not reach) become one :class:`ConnectionError` (:func:`no_ray`).

    Raises:
        ConnectionError: no Ray answered at ``address`` within ``timeout``.
    """
    global _joining
    deadline = time.monotonic() + timeout
    earlier = _joining
    if earlier is not None:
        while earlier.is_alive() and time.monotonic() < deadline:
            earlier.join(WAIT_SLICE)
        if earlier.is_alive():
            raise no_ray(address, "an earlier join that timed out still waits on Ray")
        _joining = None
    endpoints = _endpoints(address)
    if endpoints:
        endpoint = _listening(address, endpoints, deadline)
        _speaks_grpc(address, endpoint, deadline, timeout)
    state: dict[str, Any] = {}
    state_lock = threading.Lock()
    done = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # as ray.init does in the main thread

    def run() -> None:
        quiet = _NotInTheMainThread()
        worker_logger = logging.getLogger(ray_worker.__name__)
        worker_logger.addFilter(quiet)
        try:
            ray.init(**kwargs)
        except BaseException as exc:  # SystemExit too: Ray exits when its GCS never answers
            state["error"] = exc
        finally:
            worker_logger.removeFilter(quiet)
        with state_lock:
            done.set()
            abandoned = state.get("abandoned", False)
        if abandoned and "error" not in state:
            ray.shutdown()  # the caller gave up on this connection

    thread = threading.Thread(target=run, name="envfleet-ray-join", daemon=True)
    thread.start()
    try:
        while not done.wait(max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise no_ray(
                    address, f"Ray did not finish connecting within connect_timeout={timeout:g}s"
                )
    except BaseException:  # the timeout, or a Ctrl-C
        with state_lock:
            state["abandoned"] = True
            finished = done.is_set()
        if finished and "error" not in state:
            ray.shutdown()
        elif not finished:
            _joining = thread
        raise
    error = state.get("error")
    if error is None:
        return
    if isinstance(error, SystemExit):
        raise no_ray(address, "Ray gave up reaching the cluster's GCS there") from error
    if isinstance(error, ConnectionError):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise no_ray(address, lines[-1] if lines else type(error).__name__) from error
    raise error


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


def disconnect() -> None:
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


def leave_ray_alone() -> None:
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


def forked() -> None:
    """In a forked child: the connection, the Ray and its reaper are the parent's. Forget
    them, and leave Ray alone at exit (:func:`leave_ray_alone`)."""
    global _session, _users, _reaper
    _session, _users, _reaper = None, 0, None
    leave_ray_alone()


__all__ = [
    "CONNECT_TIMEOUT",
    "PROBE_TIMEOUT",
    "REAPER",
    "SOCKET_DIR_PREFIX",
    "START_ATTEMPTS",
    "START_BACKOFF",
    "WAIT_SLICE",
    "await_start",
    "client_connected",
    "connect",
    "describe_cluster",
    "disconnect",
    "forked",
    "join",
    "leave_ray_alone",
    "loopback",
    "make_socket_dir",
    "no_ray",
    "pool_node",
]
