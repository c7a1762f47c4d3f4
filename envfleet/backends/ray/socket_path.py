"""The Ray backend's socket path: the actors on the pool's machine, served over Unix sockets.

Such an actor maps the pool's batch memory (:mod:`~envfleet.backends.ray.memory`) and takes its
commands over a socket, through the loop the process backend's workers run
(:func:`~envfleet.backends.contract.channel.serve_connection`): Ray only places, starts,
watches and kills it. :class:`ActorSockets` connects to each (with the pool's key), sends
without blocking (a command the socket has no room for waits in the actor's
:class:`~envfleet.backends.contract.outbox.Outbox`, written as the socket drains, within
:meth:`ActorSockets.wait`), waits on them all with one ``poll`` and reads their replies; a
socket that closes is the actor lost.
"""

from __future__ import annotations

import math
import select
import socket
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium

from envfleet.backends.contract.base import WorkerLost
from envfleet.backends.contract.connections import connect_pool
from envfleet.backends.contract.outbox import Outbox
from envfleet.backends.contract.rows import deliver
from envfleet.backends.ray.worker_actor import ActorSlot
from envfleet.buffers import Batch
from envfleet.protocol import Reply

__all__ = ["ActorSockets"]


class ActorSockets:
    """The sockets of the actors of ``workers`` that run on the pool's machine; their replies'
    rows are delivered into ``batch``."""

    def __init__(
        self,
        workers: Sequence[ActorSlot],
        authkey: bytes,
        batch: Batch,
        space: gymnasium.Space[Any],
    ) -> None:
        self._workers = workers
        self._authkey = authkey
        self._batch = batch
        self._space = space
        self._poller = select.poll()
        self.writing: set[int] = set()  # workers whose outbox holds bytes

    def connect(self, worker: int, address: str) -> None:
        """Connect to ``worker``'s actor listening at ``address``, once it serves there.

        Raises:
            OSError, EOFError, AuthenticationError: it could not be reached, or its key was not
                the pool's.
        """
        slot = self._workers[worker]
        slot.serving = slot.handle.serve.remote()
        conn = connect_pool(address, self._authkey)
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
                self.writing.add(worker)
                self._poller.modify(fd, select.POLLIN | select.POLLOUT)
            elif worker in self.writing:
                self._poller.modify(fd, select.POLLIN)

        return watch

    def wait(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        """The replies that came within ``timeout`` (one per actor at most), writing what
        waits in the outboxes as their sockets take it."""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        while True:
            try:
                events = self._poller.poll(ms)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
        ready = {fd for fd, mask in events if mask != select.POLLOUT}
        workers = self._workers
        if self.writing:  # commands wait for room in their sockets
            writable = {fd for fd, mask in events if mask & select.POLLOUT}
            for worker in list(self.writing):
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
                    self._batch.infos.put(reply)
                    reply = None
                elif reply is not None and reply.rows is not None:
                    deliver(self._batch, self._space, reply)
                replies.append((worker, reply))
                slot.owed -= 1
            except (EOFError, OSError):
                self.drop(worker)
                replies.append((worker, WorkerLost(None, "ray actor exited (its socket closed)")))
        return replies

    def drop(self, worker: int) -> None:
        """Close ``worker``'s socket (if it has one) and forget what it owed."""
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
