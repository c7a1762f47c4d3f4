"""A node agent's door, its sends and its leftovers, without a cluster.

The agent's listening socket checks each connection on a thread of its own, the whole
handshake within one deadline, so a stranger, however slowly it answers, neither holds the door
past that bound nor keeps the pool's own connection waiting; a message to a peer that takes
nothing (a stopped agent) ends within its bound, and one to a peer that is itself writing to
us is not a deadlock; the temp directories of agents that were killed are removed.

Then, on a fake cluster (a head and one worker node of ``ray.cluster_utils.Cluster``, shared by
the module): a pool's ``close()`` returns once its agents' processes on this machine are gone,
leaving nothing in the temp dir; a large command to a stopped agent loses its node within
``step_timeout``; an agent killed through Ray is named, node and all.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
import pytest

import envfleet
from envfleet.backends.contract import connections
from envfleet.backends.nodes import agent as node_agent
from envfleet.backends.nodes.actors import connect_agent
from envfleet.backends.nodes.frames import Frames, SendTimeout, send
from envfleet.backends.ray.ended import alive, bury, ended
from tests import timing
from tests.ray_helpers import no_node_leaks

__all__ = ["no_node_leaks"]  # fixtures, used by name

KEY = b"k" * 32
WAIT = 60.0
"""Seconds a test waits for what should happen within a second or so (a busy machine)."""


class Door:
    """An agent's listening socket, its :func:`~connections.accept_pool` on a thread."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0), backlog=8)
        self.port = int(self.server.getsockname()[1])
        self.accepted: list[Connection] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.accepted.append(connections.accept_pool(self.server, KEY))

    def close(self) -> None:
        if self.thread.is_alive():  # let it return: the pool's own connection
            connect_agent("127.0.0.1", self.port, KEY, timeout=WAIT).close()
        self.thread.join(WAIT)
        for conn in self.accepted:
            conn.close()
        self.server.close()


@pytest.fixture
def door() -> Iterator[Door]:
    door = Door()
    yield door
    door.close()


class Stranger:
    """A local process that connects first and answers the challenge one byte at a time,
    every ``every`` seconds, for as long as it is let (a length of 255, then the bytes)."""

    def __init__(self, port: int, every: float) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.every = every
        self.stop = threading.Event()
        self.dropped = threading.Event()
        self.thread = threading.Thread(target=self._drip, daemon=True)
        self.thread.start()

    def _drip(self) -> None:
        drip = (255).to_bytes(4, "big") + bytes(255)
        try:
            for byte in drip:
                if self.stop.wait(self.every):
                    return
                self.sock.send(bytes([byte]))
        except OSError:
            self.dropped.set()
            return

    def still_connected(self) -> bool:
        """The door has not closed this connection (it still waits for the stranger)."""
        try:
            while True:  # what the door sent (its challenge) is not an end
                if self.sock.recv(4096, socket.MSG_DONTWAIT) == b"":
                    return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        self.sock.close()


def test_a_slow_stranger_does_not_keep_the_pool_from_its_agent(
    door: Door, monkeypatch: Any
) -> None:
    """A stranger connects first and drips its answer (its handshake bound made two minutes
    here): the pool's connection, made after it, is accepted while the stranger still drips,
    and the stranger is dropped then."""
    monkeypatch.setattr(connections, "HANDSHAKE_TIMEOUT", 120.0)
    stranger = Stranger(door.port, every=0.5)
    try:
        time.sleep(0.5)  # the stranger's connection is taken (and checked) first
        conn = connect_agent("127.0.0.1", door.port, KEY, timeout=WAIT)
        # Its answer takes 130 s: it was still dripping when the pool got in.
        assert stranger.thread.is_alive() and not stranger.dropped.is_set()
        conn.close()
        door.thread.join(WAIT)
        assert len(door.accepted) == 1
        deadline = time.monotonic() + WAIT  # and once the pool is in, it is dropped
        while stranger.still_connected() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stranger.still_connected()
    finally:
        stranger.close()


def test_a_stranger_gets_one_deadline_for_the_whole_handshake(door: Door, monkeypatch: Any) -> None:
    """A stranger sending a byte of its answer every 0.2 s, far within a per-read bound, is
    dropped once the whole handshake's bound (1 s here) has passed, not 51 s later."""
    monkeypatch.setattr(connections, "HANDSHAKE_TIMEOUT", 1.0)
    stranger = Stranger(door.port, every=0.2)
    try:
        deadline = time.monotonic() + WAIT / 2  # its answer would take 51 s
        while stranger.still_connected() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stranger.still_connected(), "the stranger still holds its handshake"
    finally:
        stranger.close()


def test_the_pool_and_the_agent_prove_the_key_both_ways(door: Door) -> None:
    with pytest.raises(AuthenticationError):
        connect_agent("127.0.0.1", door.port, b"x" * 32, timeout=WAIT)
    conn = connect_agent("127.0.0.1", door.port, KEY, timeout=WAIT)
    door.thread.join(WAIT)
    conn.send_bytes(b"hello")
    assert door.accepted[0].recv_bytes() == b"hello"
    conn.close()


def test_a_handshake_with_a_silent_agent_ends_within_its_bound() -> None:
    """The pool's side: an agent that accepts and says nothing fails the connection within
    the bound given (one deadline, not one per read)."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(TimeoutError):
            connect_agent("127.0.0.1", server.getsockname()[1], KEY, timeout=0.5)
    finally:
        server.close()


def test_a_send_to_a_peer_that_takes_nothing_ends_within_its_bound() -> None:
    """A 16 MB message to a peer that reads nothing (a stopped agent) ends, SendTimeout."""
    ours, theirs = socket.socketpair()
    try:
        with pytest.raises(SendTimeout, match=r"within 0\.5s"):
            send(ours.fileno(), [bytes(16 << 20)], 0.5, ours)
    finally:
        ours.close()
        theirs.close()


def test_a_send_reads_what_the_peer_writes_meanwhile() -> None:
    """Both ends write a message larger than the sockets hold: the peer reads only once it has
    written all of its own. The send takes the peer's message in as it goes (``waiting``), so
    neither end blocks for good."""
    ours, theirs = socket.socketpair()
    size = 16 << 20
    got: list[bytes | bytearray] = []
    frames = Frames(ours.fileno())

    def peer() -> None:
        send(theirs.fileno(), [b"a" * size])  # blocking: until we read it
        got.append(Frames(theirs.fileno()).read())

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    taken: list[bytes | bytearray] = []

    def waiting() -> None:
        while frames.ready():
            taken.append(frames.read())

    try:
        send(ours.fileno(), [b"b" * size], WAIT, ours, waiting)
        thread.join(WAIT)
        assert [len(m) for m in taken] == [size] and taken[0][:1] == b"a"
        assert [len(m) for m in got] == [size] and got[0][:1] == b"b"
    finally:
        ours.close()
        theirs.close()
        thread.join(WAIT)


def test_the_temp_dirs_of_ended_agents_are_removed(tmp_path: Any) -> None:
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(ended.stdout)
    gone = tmp_path / f"{node_agent.AGENT_DIR_PREFIX}{dead}-abc"
    gone.mkdir()
    (gone / "listener-x").write_text("")
    live = tmp_path / f"{node_agent.AGENT_DIR_PREFIX}{os.getpid()}-def"
    live.mkdir()
    other = tmp_path / "pymp-keep"
    other.mkdir()
    parent, zombie = _unreaped()  # an agent the raylet has not reaped yet
    unreaped = tmp_path / f"{node_agent.AGENT_DIR_PREFIX}{zombie}-ghi"
    unreaped.mkdir()
    try:
        node_agent.remove_dead_agents_dirs(str(tmp_path))
    finally:
        parent.kill()
        parent.wait(WAIT)
    assert not gone.exists() and not unreaped.exists()
    assert live.exists() and other.exists()


def _unreaped() -> tuple[subprocess.Popen[bytes], int]:
    """A process that has exited and that its parent, not this process, has not reaped (an
    actor's process once Ray has killed it, till the raylet reaps it): the parent, and its
    pid."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _NOT_REAPING], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    return parent, pid


_NOT_REAPING = (
    "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'pass']); "
    "print(child.pid, flush=True); time.sleep(600)"
)


def test_bury_counts_an_exited_process_ended_and_kills_one_past_its_timeout() -> None:
    """What a pool's close waits for once Ray has killed its actors: a process that exited
    counts as ended though its parent has not reaped it (the raylet does, in its own time); one
    still running past ``timeout`` is killed."""
    parent, pid = _unreaped()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        watched = [psutil.Process(pid), psutil.Process(running.pid)]
        assert ended(watched[0]) and not alive(pid)
        assert not ended(watched[1]) and alive(running.pid)
        began = time.monotonic()
        bury(watched[:1], WAIT)
        assert time.monotonic() - began < WAIT, "bury waited for an exited process's reaping"
        bury(watched, 0.2)
        assert running.wait(WAIT) == -signal.SIGKILL and ended(watched[1])
    finally:
        for process in (running, parent):
            process.kill()
            process.wait(WAIT)


NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
NUM_ENVS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def make_on_worker_node(cluster: Any, **kwargs: Any) -> envfleet.Pool:
    return envfleet.make(
        "CartPole-v1",
        NUM_ENVS,
        backend="ray",
        num_workers=2,
        nodes=[next(iter(cluster.worker_nodes)).node_id],
        seed=0,
        **kwargs,
    )


def temp_entries() -> set[str]:
    temp = tempfile.gettempdir()
    return set(glob.glob(os.path.join(temp, "pymp-*"))) | set(
        glob.glob(os.path.join(temp, f"{node_agent.AGENT_DIR_PREFIX}*"))
    )


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def test_close_waits_for_its_agents_and_leaves_nothing_in_the_temp_dir(cluster: Any) -> None:
    """The agent's fork server's socket is in its own directory, not a ``pymp-*``; after
    ``close()`` the agent, its fork server and its workers have ended, and that directory is
    gone (with no ``atexit``: the agent is ended by ``ray.kill``)."""
    before = temp_entries()
    pool = make_on_worker_node(cluster)
    try:
        pool.reset()
        pool.step(np.ones(NUM_ENVS, dtype=np.int64))
        agent = psutil.Process(pool._transport._nodes[0].pid)
        processes = [agent, *agent.children(recursive=True)]
        assert len(processes) >= 3  # the agent, its fork server, its workers
        new = temp_entries() - before
        assert new and all(node_agent.AGENT_DIR_PREFIX in path for path in new), new
    finally:
        pool.close()
    left = [p.pid for p in processes if not gone(p)]
    assert not left, f"the agent's processes {left} outlived close()"
    assert temp_entries() - before == set()


def test_a_large_command_to_a_stopped_agent_loses_its_node_within_step_timeout(
    cluster: Any,
) -> None:
    """A 64 MB ``set_attr`` to a node whose agent is stopped (SIGSTOP) does not block the pool:
    past ``step_timeout`` with no byte taken, the node is lost, and the error names it."""
    step_timeout = timing.bound(1.5, pools=3)
    pool = make_on_worker_node(cluster, step_timeout=step_timeout)
    pid = 0
    try:
        pool.reset()
        node = pool._transport._nodes[0]
        pid = node.pid
        os.kill(pid, signal.SIGSTOP)
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                pool.set_attr("blob", bytes(64 << 20))
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(step_timeout + WAIT)
        assert outcome, "set_attr to a stopped agent still blocks"
        error = outcome[0]
        assert isinstance(error, envfleet.WorkerDiedError), error
        assert node.node_id in str(error) and "took no byte" in str(error)
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        pool.close()


def test_a_worker_lost_on_a_node_is_named_with_its_node() -> None:
    """A worker that the agent reports lost (its reason as the agent saw it: "exit code 255")
    reaches the pool naming the node and its address too."""
    from envfleet.backends.contract.base import WorkerLost
    from envfleet.backends.nodes import wire
    from envfleet.backends.nodes.link import NodeLink

    node = NodeLink(0, "n0de", [3, 4], host="10.0.0.7")
    node.started()
    parts = wire.header_parts(wire.GENERAL, ([(1, WorkerLost(255, "exit code 255"))], []))
    replies = node.take(b"".join(parts), [], None, None, np.zeros(4, np.int64))  # type: ignore[arg-type]
    assert replies == [(4, WorkerLost(255, "exit code 255 on node n0de (10.0.0.7)"))]
