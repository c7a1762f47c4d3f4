"""The thread backend: each worker is a thread of the caller's process.

For envs that sleep (a remote simulator, a game server, I/O) or release the GIL in C code
(ALE's emulator, MuJoCo, Box2D): groups write straight into the pool's batch arrays, with no
copies and no inter-process messages. Pure-Python envs gain nothing here (the GIL runs one
at a time); use the process backend for them. A thread cannot be killed, so ``step_timeout``
is not offered on this backend.

How commands reach the threads matters more than it seems: with one thread per env, every
thread needs the GIL twice per step (to start the step, and to report it), and all of that
runs one thread at a time. Waking 32 threads one lock at a time costs the pool's thread a
system call each *while it holds the GIL*, so no worker can start until the last is woken.
So a whole-pool step (:meth:`ThreadTransport.submit_all`) rings one shared bell (an eventfd on
Linux, else a pipe), one system call made without the GIL that wakes every worker at once.
Single commands (async steps, calls) ring the worker's own bell. An idle worker waits on both
with ``poll``. Nobody takes the shared ring down while the workers answer: whole-pool rounds
alternate between two shared bells, a worker done with round ``r`` waits on the other one, and
the pool clears that one as it starts round ``r + 1`` (when every worker is past round ``r``),
so a worker spends no extra system call (and GIL hand-off) per round.

Replies gather under one lock and the waiting pool is woken once enough are in (see
:meth:`ThreadTransport.wait`'s ``want``), not once per reply.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from collections.abc import Sequence

from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    TransportOptions,
    WorkerLost,
)
from envfleet.backends.contract.replies import plain
from envfleet.buffers import Batch
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Close, Command, EnvFailure, Group, Reply
from envfleet.worker import serve, start_group

_STOP = None
_EVENTFD = hasattr(os, "eventfd")


class _Bell:
    """A flag threads can ``poll`` on: an eventfd where there is one, else a pipe."""

    def __init__(self) -> None:
        if _EVENTFD:
            self.fd = self._write_fd = os.eventfd(0, os.EFD_CLOEXEC)
        else:  # pragma: no cover - platforms without eventfd
            self.fd, self._write_fd = os.pipe()

    def ring(self) -> None:
        if _EVENTFD:
            os.eventfd_write(self._write_fd, 1)
        else:  # pragma: no cover
            os.write(self._write_fd, b"\0")

    def clear(self) -> None:
        """Remove every ring (call only when ``poll`` said there is one)."""
        if _EVENTFD:
            os.eventfd_read(self.fd)
        else:  # pragma: no cover
            os.read(self.fd, 1 << 16)

    def close(self) -> None:
        os.close(self.fd)
        if self._write_fd != self.fd:  # pragma: no cover
            os.close(self._write_fd)


class ThreadTransport(BaseTransport, BaseWorkers):
    """One thread per worker, each serving its group's commands in order."""

    def __init__(self, options: TransportOptions) -> None:
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self._options = options
        self._replies: deque[tuple[int, Reply | WorkerLost | None]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Lock()  # held while the pool has no reason to wake up
        self._wake.acquire()
        self._want = 0  # replies the waiting pool needs (0: the pool is not waiting)
        # Per worker: commands tagged with their round (0: a single command, else whole-pool).
        self._inboxes: list[deque[tuple[int, Command | None]]] = []
        self._bells: list[_Bell] = []
        self._rounds = (_Bell(), _Bell())
        self._round = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._running = len(options.assignment)  # threads not ended yet
        self._bells_open = True
        try:
            for worker, ids in enumerate(options.assignment):
                inbox: deque[tuple[int, Command | None]] = deque()
                bell = _Bell()
                self._inboxes.append(inbox)
                self._bells.append(bell)
                thread = threading.Thread(
                    target=self._serve,
                    args=(worker, ids, inbox, bell),
                    name=f"envfleet-thread-{worker}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        except BaseException:
            self.close(1.0)
            raise
        self._await_start()

    def _await_start(self) -> None:
        failure: tuple[int, EnvFailure] | None = None
        options = self._options
        deadline = time.monotonic() + options.start_timeout
        started: set[int] = set()
        while len(started) < len(self._threads):
            remaining = deadline - time.monotonic()
            replies = self.wait(max(0.0, remaining), want=len(self._threads) - len(started))
            if not replies and remaining <= 0:
                late = sorted(set(range(len(self._threads))) - started)
                self.close(0.0)  # a thread cannot be stopped: the stuck ones are abandoned
                ids = tuple(i for w in late for i in options.assignment[w])
                raise EnvTimeoutError(
                    f"worker {late[0]} did not build its envs {list(options.assignment[late[0]])}"
                    f" ({options.spec.name}) within start_timeout={options.start_timeout:g}s; "
                    "its thread cannot be stopped and was abandoned (threads of workers "
                    f"{late} are stuck)",
                    env_index=None,
                    phase=Phase.MAKE,
                    worker=late[0],
                    env_ids=ids,
                )
            for worker, reply in replies:
                started.add(worker)
                if isinstance(reply, Reply) and reply.failures and failure is None:
                    failure = (worker, reply.failures[0])
                elif isinstance(reply, WorkerLost) and failure is None:
                    failure = (worker, _lost_at_start(reply))
        if failure is not None:
            self.close(1.0)
            raise failure[1].to_error(failure[0], options.spec.name)

    def _serve(
        self,
        worker: int,
        ids: tuple[int, ...],
        inbox: deque[tuple[int, Command | None]],
        bell: _Bell,
    ) -> None:
        try:
            group, started = start_group(
                self._options,
                ids,
                self.batch,
                rebuild_thread_timeout=self._options.start_timeout,  # a stuck rebuild: abandoned
            )
            self._post(worker, started)
            if group is None:
                return
            self._loop(worker, group, inbox, bell)
        except BaseException as exc:  # a thread that ends must say so
            # The group turns an env's exceptions into failures; anything reaching here ended
            # this worker, which the pool must hear of, like a dead process, not wait forever.
            self._post(worker, WorkerLost(None, f"its thread ended: {type(exc).__name__}"))
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0 and self._closed
            if last:  # the pool's close() gave up waiting for this thread: the bells close now
                self._close_bells()

    def _loop(
        self, worker: int, group: Group, inbox: deque[tuple[int, Command | None]], bell: _Bell
    ) -> None:
        rounds = self._rounds
        waits = []  # waits[k]: this worker's bell and the round bell of rounds with parity k
        for shared in rounds:
            poller = select.poll()
            poller.register(bell.fd, select.POLLIN)
            poller.register(shared.fd, select.POLLIN)
            waits.append(poller.poll)
        last = 0  # the last whole-pool round served
        own = bell.fd
        post = self._post
        while True:
            if not inbox:
                for fd, _ in waits[(last + 1) & 1]():  # blocks without the GIL
                    if fd == own:
                        bell.clear()
                continue
            round_, command = inbox.popleft()
            if command is _STOP:
                group.close()
                return
            if round_:
                last = round_
            reply = serve(group, command)
            post(worker, None if plain(reply) else reply)
            if isinstance(command, Close):
                return

    def submit(self, worker: int, command: Command) -> None:
        self._inboxes[worker].append((0, command))
        self._bells[worker].ring()

    def submit_all(self, commands: Sequence[Command]) -> None:
        """One command per worker, all at once: one ring of a shared bell wakes them all.

        Only when every worker has answered everything sent before (a whole-pool step, all
        envs idle): then no worker waits on the bell of the previous round any more, and it
        can be cleared for the next.
        """
        self._round += 1
        round_ = self._round
        if round_ > 1:
            self._rounds[(round_ - 1) & 1].clear()
        for inbox, command in zip(self._inboxes, commands, strict=True):
            inbox.append((round_, command))
        self._rounds[round_ & 1].ring()

    def _post(self, worker: int, reply: Reply | WorkerLost | None) -> None:
        with self._lock:
            self._replies.append((worker, reply))
            if self._want and len(self._replies) >= self._want:
                self._want = 0
                self._wake.release()

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        with self._lock:
            if len(self._replies) < max(1, want) and timeout != 0 and not self._closed:
                self._want = max(1, want)
            else:  # in, only a look, or closed (what was not begun is dropped: no reply comes)
                return self._take_replies()
        woken = self._wake.acquire(timeout=-1 if timeout is None else timeout)
        with self._lock:
            if not woken and not self._want:  # a reply woke us just as the wait timed out
                self._wake.acquire()
            self._want = 0
            return self._take_replies()

    def _take_replies(self) -> list[tuple[int, Reply | WorkerLost | None]]:
        replies = list(self._replies)
        self._replies.clear()
        return replies

    def kill(self, worker: int) -> None:
        raise NotImplementedError("a thread cannot be killed; use the process backend")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        ids = tuple(self._options.assignment[worker])
        raise WorkerDiedError(
            f"the thread of worker {worker} (envs {list(ids)}) ended and a thread worker "
            "cannot be replaced",
            env_index=None,
            phase=Phase.STEP,
            worker=worker,
            env_ids=ids,
        )

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        with self._lock:  # the last thread to end closes the bells: not while they ring
            self._closed = True
            for worker in range(len(self._threads)):
                # What it has not begun (a rollout's part queued behind another) is dropped:
                # it stops once its current command is done, and steps no env after that.
                self._inboxes[worker].clear()
                self._inboxes[worker].append((0, _STOP))
                if self._bells_open:
                    self._bells[worker].ring()
            if self._want:  # a wait in another thread: its replies may have been dropped
                self._want = 0
                self._wake.release()
        deadline = time.monotonic() + timeout
        stuck = False
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            stuck = stuck or thread.is_alive()
        # A thread stuck inside an env is a daemon: it cannot block interpreter exit. Its bells
        # stay open (it may still poll them) until the last thread ends, which closes them
        # (they leaked when close() stopped waiting first, as close(timeout=0) always does).
        if not stuck:
            self._close_bells()

    def _close_bells(self) -> None:
        with self._lock:
            if not self._bells_open:
                return
            self._bells_open = False
        for bell in (*self._bells, *self._rounds):
            bell.close()


def _lost_at_start(lost: WorkerLost) -> EnvFailure:
    try:
        raise RuntimeError(f"a worker thread ended while building its envs: {lost.reason}")
    except RuntimeError as exc:
        return EnvFailure.capture(None, Phase.MAKE, exc)


def open_transport(options: TransportOptions) -> ThreadTransport:
    return ThreadTransport(options)


__all__ = ["ThreadTransport", "open_transport"]
