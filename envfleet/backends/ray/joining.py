"""Joining a Ray cluster at an address, bounded (:func:`join`).

A quick look at the address first (nothing listening there fails in well under a second),
then ``connect_timeout`` for the whole join, and the caller's Ctrl-C is taken at once; past it,
one :class:`ConnectionError` names the address, says that no Ray answered there and how to
start one (:func:`no_ray`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import ray
import ray._private.worker as ray_worker

CONNECT_TIMEOUT = 20.0
"""Seconds a join of a cluster may take in all (``RayOptions.connect_timeout``), see
:func:`join`."""

PROBE_TIMEOUT = 1.0
"""Seconds the first look at a cluster's address gives a TCP connection to open there."""

WAIT_SLICE = 0.1
"""The join waits in slices this long, so that a Ctrl-C stops it at once."""


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


__all__ = ["CONNECT_TIMEOUT", "PROBE_TIMEOUT", "WAIT_SLICE", "join", "no_ray"]
