"""The socket between the pool and a Ray actor on its machine: only the pool gets in, and no
side of the handshake waits without a bound (a stranger cannot hang ``make()``)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import pytest

from envfleet.backends.contract import connections

KEY = b"k" * 32


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    server, address, directory = connections.open_listener()
    try:
        yield server, address
    finally:
        server.close()
        if directory is not None:
            shutil.rmtree(directory)


def _accept_in_thread(server: socket.socket) -> tuple[threading.Thread, list[Connection]]:
    accepted: list[Connection] = []
    thread = threading.Thread(
        target=lambda: accepted.append(connections.accept_pool(server, KEY)), daemon=True
    )
    thread.start()
    return thread, accepted


@pytest.mark.timeout(30)
def test_strangers_are_dropped_and_the_pool_still_gets_in(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connections, "HANDSHAKE_TIMEOUT", 0.5)
    server, address = listener
    thread, accepted = _accept_in_thread(server)
    started = time.monotonic()
    silent = socket.socket(socket.AF_UNIX)  # connects first and says nothing
    silent.connect(address)
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(address)
    garbage.sendall(b"\xff" * 64)
    with pytest.raises((AuthenticationError, EOFError, OSError)):
        Client(address, authkey=b"wrong key")
    conn = connections.connect_pool(address, KEY, timeout=10.0)
    thread.join(10.0)
    assert accepted, "the actor never took the pool's connection"
    assert time.monotonic() - started < 10.0
    conn.send("ping")
    assert accepted[0].recv() == "ping"
    for sock in (silent, garbage):
        sock.close()
    conn.close()
    accepted[0].close()


@pytest.mark.timeout(30)
def test_a_silent_actor_does_not_hang_the_pool() -> None:
    """The pool's side of the handshake has its bound too (a socket that never answers)."""
    server = socket.socket(socket.AF_UNIX)
    address = f"\0envfleet-test-{os.getpid()}"
    server.bind(address)
    server.listen(1)
    started = time.monotonic()
    with pytest.raises(OSError):
        connections.connect_pool(address, KEY, timeout=0.5)
    assert time.monotonic() - started < 5.0
    server.close()


@pytest.mark.timeout(30)
def test_other_users_cannot_reach_the_socket(listener: tuple[socket.socket, str]) -> None:
    """The socket lives in a directory only its owner may enter: another uid is refused by the
    kernel before any handshake."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a process as a second user (os.setuid)")
    _server, address = listener
    directory = os.path.dirname(address)
    assert address.startswith("/"), "a filesystem socket, not an abstract one"
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    stranger = 54321  # a uid of no one here: a second user as far as the kernel is concerned
    pid = os.fork()
    if pid == 0:  # the child: become the stranger and try to connect
        code = 3
        try:
            os.setgid(stranger)
            os.setuid(stranger)
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(address)
                code = 1  # got in
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "another user reached the socket"
