"""Joining a Ray cluster is bounded, and its failure is one explained error.

``make(backend="ray", address=...)`` where no Ray runs fails with a :class:`ConnectionError`
that names the address, says that no Ray answered and how to start one: at once when nothing
listens there (``host:port``, ``ray://host:port``, ``"auto"`` through ``RAY_ADDRESS``), within
``connect_timeout`` when something that is not Ray does, or when Ray itself does not finish
connecting; a Ctrl-C stops the join at once. No Ray is started or left connected by any of it.
The command line says it in one error line.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

import envfleet
from envfleet.backends.ray import joining as ray_joining
from envfleet.backends.ray import session as ray_session
from envfleet.cli import main

QUICK = 30.0
"""Seconds a join that must fail at once may take on a busy machine (its ``connect_timeout``
is far longer, :data:`LONG`): about a millisecond when nothing is busy."""

LONG = 300.0
"""A ``connect_timeout`` that the tests of a fast failure never reach."""


@pytest.fixture
def free_port() -> int:
    """A port on the loopback address where nothing listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port where something listens, accepts and never says a word (not Ray)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


@pytest.fixture(autouse=True)
def no_ray_connected() -> Iterator[None]:
    """Each test begins and ends with this process on no Ray, and no join still running."""
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized(), "a failed join left this process connected to Ray"
    joining = ray_joining._joining
    if joining is not None:
        joining.join(10)
        assert not joining.is_alive()
        ray_joining._joining = None


def make_joining(address: str, **kwargs: Any) -> envfleet.Pool:
    return envfleet.make("CartPole-v1", 2, backend="ray", address=address, **kwargs)


def assert_explained(error: BaseException, address: str) -> None:
    text = str(error)
    assert f"no Ray answered at {address}" in text, text
    assert "ray start --head" in text and "RAY_ADDRESS" in text, text


@pytest.mark.parametrize("scheme", ["", "ray://"], ids=["gcs", "ray-client"])
def test_nothing_listening_fails_at_once_naming_the_address_and_the_fix(
    free_port: int, scheme: str
) -> None:
    address = f"{scheme}127.0.0.1:{free_port}"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        make_joining(address, connect_timeout=LONG)
    assert time.monotonic() - started < QUICK
    assert_explained(caught.value, address)
    assert "refused" in str(caught.value).lower()


def test_auto_with_ray_address_naming_a_closed_port_fails_at_once(
    free_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port}")
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        make_joining("auto", connect_timeout=LONG)
    assert time.monotonic() - started < QUICK
    assert_explained(caught.value, "auto")


@pytest.mark.parametrize("scheme", ["", "ray://"], ids=["gcs", "ray-client"])
def test_something_that_is_not_ray_fails_past_connect_timeout(
    silent_server: int, scheme: str
) -> None:
    address = f"{scheme}127.0.0.1:{silent_server}"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        make_joining(address, connect_timeout=1)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 1.0 + QUICK
    assert_explained(caught.value, address)
    assert "connect_timeout=1s" in str(caught.value)


@pytest.fixture
def hanging_init(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """``ray.init`` that hangs until released (as a join to a Ray that never finishes does),
    past the look at the address (nothing to look at); ``ray.shutdown`` noted."""
    seen: dict[str, Any] = {"release": threading.Event(), "shutdowns": 0, "inits": 0}
    connected = threading.Event()

    def init(**kwargs: Any) -> None:
        seen["inits"] += 1
        seen["release"].wait(60)
        connected.set()

    def shutdown() -> None:
        seen["shutdowns"] += 1
        connected.clear()

    monkeypatch.setattr(ray_joining, "_endpoints", lambda address: [])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    try:
        yield seen
    finally:
        seen["release"].set()
        joining = ray_joining._joining
        if joining is not None:
            joining.join(10)
            ray_joining._joining = None


def wait_until(condition: Callable[[], bool], timeout: float = QUICK) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_join_that_never_finishes_fails_at_connect_timeout_and_is_let_go(
    hanging_init: dict[str, Any],
) -> None:
    """Past the timeout the caller has its error; the join, once Ray lets it go, disconnects
    the connection nobody waits for."""
    with pytest.raises(ConnectionError) as caught:
        ray_session.connect("127.0.0.1:6399", {}, timeout=0.5)
    assert_explained(caught.value, "127.0.0.1:6399")
    assert "did not finish connecting within connect_timeout=0.5s" in str(caught.value)
    assert ray_session._session is None
    hanging_init["release"].set()
    assert wait_until(lambda: hanging_init["shutdowns"] == 1)


CTRL_C_SCRIPT = """
import signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's process has it
import ray
from envfleet.backends.ray import joining, session
release = threading.Event()
joining._endpoints = lambda address: []  # nothing to look at: straight to ray.init
ray.init = lambda **kwargs: release.wait(600)  # a join to a Ray that never finishes
ray.shutdown = lambda: None
print("joining", flush=True)
started = time.monotonic()
try:
    session.connect("127.0.0.1:6399", {}, timeout=600)
except KeyboardInterrupt:
    print("interrupted after", round(time.monotonic() - started, 2), flush=True)
    sys.exit(0)
sys.exit(3)
"""


def test_ctrl_c_stops_a_join_at_once() -> None:
    """A real SIGINT (Ctrl-C) to a process joining a Ray that never answers: the join gives up
    at once. In a process of its own, with Python's own SIGINT handler (a test runner's worker
    may ignore SIGINT, and its children inherit that; ``interrupt_main`` then does nothing)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "joining"
        time.sleep(0.5)  # inside the join's wait
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=QUICK)
        assert proc.returncode == 0, out
        assert "interrupted after" in out
        assert time.monotonic() - sent < QUICK
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_join_that_ray_gives_up_on_is_a_connection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray exits (``SystemExit``) when the GCS it was sent to never answers: not the caller's
    process, but one :class:`ConnectionError`."""

    def init(**kwargs: Any) -> None:
        raise SystemExit(15)

    monkeypatch.setattr(ray_joining, "_endpoints", lambda address: [])
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConnectionError) as caught:
        ray_session.connect("127.0.0.1:6399", {}, timeout=LONG)
    assert_explained(caught.value, "127.0.0.1:6399")
    assert isinstance(caught.value.__cause__, SystemExit)


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("5", TypeError),
     (True, TypeError)],
)  # fmt: skip
def test_connect_timeout_is_checked_before_anything_starts(
    value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="connect_timeout"):
        make_joining("127.0.0.1:1", connect_timeout=value)


def test_the_command_line_says_it_in_one_line_at_once(
    free_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{free_port}"
    started = time.monotonic()
    status = main(["run", "CartPole-v1", "--backend", "ray", "--address", address, "-q"])
    assert time.monotonic() - started < QUICK
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("envfleet: error:")]
    assert status == 1, err
    assert len(errors) == 1, err
    assert f"no Ray answered at {address}" in errors[0] and "ray start --head" in errors[0]


def test_the_command_line_hides_rays_own_warnings_unless_verbose() -> None:
    """What Ray's C++ core prints while it tries a GCS that does not answer (a line every few
    seconds) is not replayed after a run, unless ``--verbose`` asked for it; its errors are."""
    from envfleet.cli.common import OutputCapture

    warning = (
        "[2026-12-06 05:40:42,256 W 5080 5080] rpc_client.h:153: Failed to connect to GCS at "
        "address 192.0.2.2:39151 within 5 seconds.\n"
    )
    error = "[2026-12-06 05:40:43,256 E 5080 5080] core_worker.cc:1: something broke\n"
    quiet, verbose = OutputCapture(replay=True), OutputCapture(replay=True, verbose=True)
    quiet.text = verbose.text = warning + error
    assert quiet.unexpected() == error
    assert verbose.unexpected() == warning + error


@pytest.mark.parametrize(
    ("found", "says"),
    [
        ("Could not find any running Ray instance.", "no Ray answered at auto"),
        ("Found multiple active Ray instances: {'a:1', 'b:2'}.", "found several Rays"),
    ],
    ids=["none", "several"],
)
def test_auto_that_finds_no_single_ray_says_so_at_once(
    monkeypatch: pytest.MonkeyPatch, found: str, says: str
) -> None:
    """``"auto"`` with no ``RAY_ADDRESS``, on a machine that runs no Ray (or several, none of
    them the latest ``ray start``): Ray's own finding, in words, before anything is tried."""
    from ray._private import services

    def canonical(address: str) -> str:
        raise ConnectionError(found)

    def init(**kwargs: Any) -> None:
        raise AssertionError("ray.init was called")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", canonical)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConnectionError, match=says) as caught:
        ray_session.connect("auto", {}, timeout=LONG)
    assert "RAY_ADDRESS" in str(caught.value)
