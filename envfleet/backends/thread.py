"""The thread backend: each worker is a thread of the caller's process.

For envs that sleep (a remote simulator, a game server, I/O) or release the GIL in C code
(ALE's emulator, MuJoCo, Box2D): groups write straight into the pool's batch arrays, with no
copies and no inter-process messages. Pure-Python envs gain nothing here (the GIL runs one
at a time); use the process backend for them. A thread cannot be killed, so ``step_timeout``
is not offered on this backend.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.buffers import Batch
from envfleet.protocol import Close, Command, EnvFailure, Reply
from envfleet.worker import plain, serve, start_group

_STOP = None


class ThreadTransport:
    """One thread per worker, each serving its group's commands in order."""

    def __init__(self, options: TransportOptions) -> None:
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self._options = options
        # Replies gather here; the waiting pool is woken once enough are in (see wait's want),
        # not once per reply: with one thread per env that saves a GIL hand-off per env.
        self._replies: deque[tuple[int, Reply | WorkerLost | None]] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._want = 1
        self._inboxes: list[queue.SimpleQueue[Command | None]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        for worker, ids in enumerate(options.assignment):
            inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._serve,
                args=(worker, ids, inbox),
                name=f"envfleet-thread-{worker}",
                daemon=True,
            )
            self._inboxes.append(inbox)
            self._threads.append(thread)
            thread.start()
        self._await_start()

    def _await_start(self) -> None:
        failure: tuple[int, EnvFailure] | None = None
        for worker, reply in self.wait(None, want=len(self._threads)):
            if isinstance(reply, Reply) and reply.failures and failure is None:
                failure = (worker, reply.failures[0])
        if failure is not None:
            self.close(1.0)
            raise failure[1].to_error(failure[0], self._options.spec.name)

    def _serve(
        self, worker: int, ids: tuple[int, ...], inbox: queue.SimpleQueue[Command | None]
    ) -> None:
        group, started = start_group(self._options, ids, self.batch)
        self._post(worker, started)
        if group is None:
            return
        while True:
            command = inbox.get()
            if command is _STOP:
                group.close()
                return
            reply = serve(group, command)
            self._post(worker, None if plain(reply) else reply)
            if isinstance(command, Close):
                return

    shares_memory = True

    def submit(self, worker: int, command: Command) -> None:
        self._inboxes[worker].put(command)

    def _post(self, worker: int, reply: Reply | WorkerLost | None) -> None:
        with self._ready:
            self._replies.append((worker, reply))
            if len(self._replies) >= self._want:
                self._ready.notify()

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        with self._ready:
            self._want = max(1, want)
            self._ready.wait_for(lambda: len(self._replies) >= self._want, timeout)
            self._want = 1
            replies = list(self._replies)
            self._replies.clear()
        return replies

    def kill(self, worker: int) -> None:
        raise NotImplementedError("a thread cannot be killed; use the process backend")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        raise NotImplementedError("a thread worker never dies on its own")

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            inbox.put(_STOP)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        # A thread stuck inside an env is a daemon: it cannot block interpreter exit.


def open_transport(options: TransportOptions) -> ThreadTransport:
    return ThreadTransport(options)
