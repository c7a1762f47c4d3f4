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

A Ray of envfleet's own gets a reaper (:mod:`~envfleet.backends.ray.reaper`), which ends its
processes should the pool's process be killed; a join is bounded
(:mod:`~envfleet.backends.ray.joining`).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
import ray._private.worker as ray_worker
from ray.exceptions import GetTimeoutError, RayError

from envfleet.backends.ray import joining, reaper
from envfleet.backends.ray.joining import CONNECT_TIMEOUT

_lock = threading.Lock()
_session: str | None = None  # the Ray connection envfleet made (see _session_id), if any
_users = 0  # open transports on that connection

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An actor that dies before it has started (placed on a node that just died, which Ray may not
know dead yet) is replaced, up to this many actors in all, ``START_BACKOFF`` seconds later and
twice as long each time (about 8 s in all), see :func:`await_start`."""


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
            joining.join(str(kwargs["address"]), kwargs, timeout)
        _session, _users = _session_id(), 1
        if private:
            reaper.start()
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
        reaper.stop()


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
    global _session, _users
    _session, _users = None, 0
    reaper.forget()
    leave_ray_alone()


__all__ = [
    "START_ATTEMPTS",
    "START_BACKOFF",
    "await_start",
    "client_connected",
    "connect",
    "describe_cluster",
    "disconnect",
    "forked",
    "leave_ray_alone",
    "loopback",
    "pool_node",
]
