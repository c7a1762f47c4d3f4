"""The process backend: worker processes, shared-memory batch arrays, pipes for signalling.

::

    pool (parent)                                     worker w (child process)
    ─────────────                                     ────────────────────────
    write actions into shared rows ──┐
    1 byte "repeat the step" ────────┼─ command ──►   os.read (blocks in the kernel)
      (or a framed pickled command)  │   pipe         group.step(ids): envs write obs, rewards,
                                     │                terminations, truncations into their rows
    poll(reply pipes + sentinels) ◄──┴── reply ────   1 byte "plain" (or a framed pickled Reply
      until every pending reply is in    pipe           when there are infos, failures, ...)
    read rows

Each worker has two one-way pipes (cheaper than a duplex socket) and speaks the raw
byte protocol of :mod:`envfleet.backends.contract.framing`: the whole-pool step, sent every step,
is one byte each way, with no pickling on either side. A synchronous step asks :meth:`wait`
for every pending reply (``want``): it keeps polling, within the pool's bound, until they are
all in, so the pool takes them in one go rather than one wake-up per worker.

Waiting blocks in ``poll``/``read`` on both sides, so on a machine with few cores the envs get
every cycle (docs/benchmarks.md, "Waiting strategy"), except for the pool's bounded spins
(:mod:`~envfleet.backends.local.spin`). A worker that dies wakes the parent through its
process sentinel (a reply it had half written is dropped); a worker whose parent dies sees EOF
on its command pipe, is killed by the kernel (``PR_SET_PDEATHSIG``) or, failing both, is
stopped by a watchdog thread.

This module is the transport (submit, wait, restart, close over all the workers); what runs in
a worker process and the pool's handle on one (start it, read its replies, bury or stop it) are
:mod:`envfleet.backends.local.worker_process`'s, the waits for the workers to build their envs
and to exit :mod:`envfleet.backends.local.workers`'.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import multiprocessing.forkserver
import os
import select
import threading
import time
from collections.abc import Callable, Sequence

import cloudpickle

from envfleet.affinity import usable_cpus
from envfleet.backends.contract import spares as spare_rows
from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    Replies,
    TransportOptions,
)
from envfleet.backends.contract.framing import REPEAT_BYTES, frame
from envfleet.backends.contract.replies import PickledCommands
from envfleet.backends.contract.rows import deliver
from envfleet.backends.local import wake_order
from envfleet.backends.local.lifeline import sigint_held
from envfleet.backends.local.runnable import Runnable
from envfleet.backends.local.shm import batch_allocator
from envfleet.backends.local.spin import poll_spinning, quick, spin_seconds
from envfleet.backends.local.worker_process import (
    ONE_PLAIN,
    SPIN_SECONDS,
    WorkerProcess,
    worker_main,
)
from envfleet.backends.local.workers import await_built, wait_for_exit
from envfleet.buffers import SharedBatch
from envfleet.info_columns import Columns
from envfleet.protocol import Close, Command, Reply, Sample
from envfleet.rollout_loop import Sampled

__all__ = ["ProcessTransport"]


class ProcessTransport(BaseTransport, BaseWorkers):
    """One process per worker; the batch arrays live in shared memory.

    Args:
        options: what to start.
        info_columns: infos the workers send as columns go into :attr:`batch` (its
            :class:`~envfleet.infos.InfoTable`, which the pool reads) when True, to this
            callable when one is given (a node agent, which forwards them to its pool as they
            came), and their replies read as plain; when False, the replies carry them.
        spares: keep spare rows for a sync step's frames
            (:mod:`~envfleet.backends.contract.spares`).
        cores: the cores its waits may count on (default: the process's usable CPUs).
    """

    def __init__(
        self,
        options: TransportOptions,
        *,
        info_columns: bool | Callable[[Columns], None] = False,
        spares: bool = False,
        cores: int | None = None,
    ) -> None:
        self._ctx = multiprocessing.get_context(options.context)
        spaces = options.observation_space, options.action_space, options.num_envs
        spare = spare_rows.SPARES * spare_rows.spare_bytes(*spaces[::2]) if spares else 0
        allocator = batch_allocator(self._ctx, SharedBatch.nbytes(*spaces) + spare)
        self._shared: SharedBatch | None = SharedBatch.allocate(*spaces, allocator)
        self.batch = self._shared.views()
        self._spare_mem, self.spares, self._spoil = spare_rows.setup(*spaces[::2], allocator, spare)
        workers = len(options.assignment)
        self._wake_mem = wake_order.allocate(allocator, workers)  # each worker's last CPU
        self._wake_order = wake_order.WakeOrder(self._wake_mem, workers)
        self._workers: list[WorkerProcess] = []
        self._writing: set[int] = set()  # workers whose outbox holds bytes (polled for room)
        self._closed = False
        self._poller = select.poll()
        self._quick = False  # the last wait got every reply within spin.SPIN_LIMIT
        self._cores = cores or len(usable_cpus())  # fewer workers owing one: it may spin
        self._runnable = Runnable()  # and only while the machine has nothing else to run
        # close() from another thread while wait() polls: a byte on this pipe wakes the poll,
        # which then touches none of the workers' descriptors (close() is closing them).
        self._wake_lock = threading.Lock()
        self._waiting = 0
        self._wake: tuple[int, int] | None = os.pipe()
        os.set_blocking(self._wake[1], False)
        self._poller.register(self._wake[0], select.POLLIN)
        self._watched: int | None = None  # see watch()
        self._pickled = PickledCommands()
        self._options = options
        self._info_columns: Callable[[Columns], None] | None = None
        if info_columns is True:
            self._info_columns = self.batch.infos.put
        elif info_columns is not False:
            self._info_columns = info_columns
        self._options_blob = cloudpickle.dumps(options)
        try:
            with sigint_held():
                for worker in range(len(options.assignment)):
                    self._start(worker, {})
            self._await_start(range(len(options.assignment)))
        except BaseException:
            self.close(1.0)
            raise

    def _start(self, worker: int, restarts: dict[int, int]) -> None:
        assert self._shared is not None
        slot = WorkerProcess.start(
            self._ctx,
            worker,
            worker_main,
            (
                self._options_blob,
                self._shared,
                os.getpid(),
                restarts,
                threading.current_thread() is threading.main_thread(),
                self._spare_mem,
                self._wake_mem,
            ),
            functools.partial(self._watcher, worker),
            self._info_columns,
        )
        if worker < len(self._workers):
            self._workers[worker] = slot
        else:
            self._workers.append(slot)
        self._poller.register(slot.reply_fd, select.POLLIN)
        self._poller.register(slot.sentinel, select.POLLIN)

    def _watcher(self, worker: int, command_fd: int) -> Callable[[bool], None]:
        """What ``worker``'s outbox calls when bytes start or stop waiting in it."""

        def watch(waiting: bool) -> None:
            if waiting and worker not in self._writing:
                self._writing.add(worker)
                self._poller.register(command_fd, select.POLLOUT)
            elif not waiting and worker in self._writing:
                self._writing.discard(worker)
                self._poller.unregister(command_fd)

        return watch

    def forked(self) -> None:
        """In a forked child: the workers are the parent's, taken out of multiprocessing's
        ``_children`` (inherited through ``os.fork``), whose exit handler would kill them."""
        children = getattr(multiprocessing.process, "_children", None)
        if isinstance(children, set):
            children.difference_update(slot.proc for slot in self._workers)

    def pids(self) -> list[int | None]:
        """Each worker's process id (a diagnostic: the processes may be gone)."""
        return [slot.proc.pid for slot in self._workers]

    def kill(self, worker: int) -> None:
        proc = self._workers[worker].proc
        if proc.is_alive():
            proc.kill()

    def memory(self, worker: int) -> int | None:
        """Resident memory of ``worker``'s process in bytes (``None``: gone or unknown)."""
        return self._workers[worker].memory()

    def _await_start(self, workers: Sequence[int]) -> None:
        await_built(self._workers, workers, self._options)

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self._spoil()
        old = self._workers[worker]
        if old.alive:  # replaced alive (recycled)
            self._poller.unregister(old.reply_fd)
            self._poller.unregister(old.sentinel)
        old.discard()
        with sigint_held():
            self._start(worker, restarts)
        self._await_start([worker])

    def prepare(self, worker: int, command: Command) -> None:
        """Pickle ``command`` now (kept for :meth:`submit`): what cannot travel fails here."""
        self._pickled.dumps(command)

    def submit_all(self, commands: Sequence[Command]) -> None:
        """A sync step: the workers on other cores than this thread's first
        (:mod:`~envfleet.backends.local.wake_order`), unless steps are quick (the last wait had
        every reply within ``spin.SPIN_LIMIT``: a worker that starts late loses little, and the
        order would cost more than it saves).

        A worker whose pipe is empty and whose last command was this one gets its repeat
        byte written here at once (the sync step's hot path); anything else goes through
        :meth:`submit`."""
        workers, write, repeat = self._workers, os.write, REPEAT_BYTES
        for worker in range(len(commands)) if self._quick else self._wake_order.order():
            command, slot = commands[worker], workers[worker]
            if command is slot.last and not slot.outbox:
                try:
                    if write(slot.command_fd, repeat):
                        continue
                except BlockingIOError:  # no room: the outbox keeps it (submit below)
                    pass
                except OSError:  # the worker is gone: its transport hears of it on the next wait
                    continue
            self.submit(worker, command)

    def land(self, worker: int, command: Sample, into: Sampled) -> None:
        """A rollout's part read from the reply pipe into ``into``
        (:class:`~envfleet.backends.LandsParts`; :mod:`~envfleet.backends.contract.landing`)."""
        self._workers[worker].reader.landing[command.env_ids] = into

    def submit(self, worker: int, command: Command) -> None:
        slot = self._workers[worker]
        if command is slot.last:
            slot.outbox.send(REPEAT_BYTES)
        else:
            slot.outbox.send(frame(self._pickled.dumps(command)))
            slot.last = command

    def wait(self, timeout: float | None, want: int = 1, linger: float | None = None) -> Replies:
        """Replies that have arrived, waiting up to ``timeout`` for the first.

        Keeps waiting (within ``timeout``) until ``want`` replies are in, a worker is lost or a
        reply reports a failure, so that a synchronous step is taken in one go; ``linger``:
        at most that long after the first reply is in (a node agent holds its fast workers'
        replies that long at most, whatever a slow worker does).
        """
        with self._wake_lock:
            if self._closed:
                return []
            self._waiting += 1
        try:
            began = time.perf_counter()
            replies = self._wait(timeout, want, linger)
            if timeout != 0 and len(replies) >= want:
                self._quick = quick(time.perf_counter() - began)
            return replies
        finally:
            with self._wake_lock:
                self._waiting -= 1
                if self._closed and not self._waiting:
                    self._close_wake()

    def watch(self, fd: int) -> None:
        """Have :meth:`wait` also end, with what is in, once ``fd`` is readable (a node agent's
        connection to its pool: the pool's next message is read at once, not after a slice)."""
        self._watched = fd
        self._poller.register(fd, select.POLLIN)

    def _wait(self, timeout: float | None, want: int, linger: float | None = None) -> Replies:
        poll = self._poller.poll
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: Replies = []
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        cores = self._cores
        # Its own tasks: itself and, of its workers, as many as it has cores (a spin waits on
        # fewer than ``cores`` of them; those that just answered may still be on their way to
        # sleep). Counting every worker let a pool of more workers than cores spin on a
        # machine busy with other work.
        own = 1 + min(len(self._workers), cores)
        while True:
            events: list[tuple[int, int]] = []
            owing = want - len(replies) if replies else None
            spin = spin_seconds(SPIN_SECONDS, owing, self._quick, cores, own, self._runnable)
            if spin > 0 and ms != 0:
                events = poll_spinning(poll, spin)
            if not events:
                try:
                    events = poll(ms)
                except InterruptedError:  # pragma: no cover - PEP 475 retries
                    continue
            if self._closed:  # by another thread: its descriptors are no longer ours to read
                return replies
            if events:
                ready = dict(events)  # fd -> its events: what is ready, looked up by fd
                if self._writing:  # commands wait for room in their pipes
                    for w in list(self._writing):
                        if self._workers[w].command_fd in ready:
                            self._workers[w].outbox.flush()
                if self._take_events(ready, replies) or self._watched in ready:
                    return replies  # a worker lost or a failure: the pool sees to it at once
            if len(replies) >= want or timeout == 0:
                return replies
            if linger is not None and replies:  # the first is in: ``linger`` more at most
                lingered = time.monotonic() + linger
                deadline = lingered if deadline is None else min(deadline, lingered)
                linger = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return replies
                ms = math.ceil(left * 1000)

    def _take_events(self, ready: dict[int, int], replies: Replies) -> bool:
        """Read the replies of the workers ``ready`` names; True if one of them is lost or
        reports a failure (raised at once, not after the other replies)."""
        stop = False
        got: list[Reply | None] = []
        for w, slot in enumerate(self._workers):
            died = slot.sentinel in ready
            if slot.alive and (slot.reply_fd in ready or died):  # what it sent before dying first
                stop = self._took(w, slot, got, not slot.read(got) or died, replies) or stop
        return stop

    def _took(
        self, w: int, slot: WorkerProcess, got: list[Reply | None], died: bool, replies: Replies
    ) -> bool:
        """Worker ``w``'s replies read (``got``, emptied) into ``replies`` (``died``: it is
        gone); True if it is lost or reports a failure."""
        stop = False
        if got == ONE_PLAIN:  # the hot path: one reply, nothing to report
            replies.append((w, None))
            got.clear()
        elif got:
            for reply in got:
                if reply is not None:
                    if reply.rows is not None:  # into the batch
                        deliver(self.batch, self._options.observation_space, reply)
                        self._spoil()
                    stop = stop or bool(reply.failures)
            replies.extend([(w, reply) for reply in got])
            got.clear()
        if died:
            gone = slot.bury(got)  # with what it sent between the first read and its exit
            replies.extend([(w, reply) for reply in got])
            got.clear()
            self._poller.unregister(slot.reply_fd)
            self._poller.unregister(slot.sentinel)
            replies.append((w, gone))
            stop = True
            self._spoil()
        return stop

    def close(self, timeout: float) -> None:
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            if self._waiting:  # another thread polls: wake it (it closes the pipe when done)
                with contextlib.suppress(OSError):
                    os.write(self._wake[1], b"\0")  # type: ignore[index]
            else:
                self._close_wake()
        workers = self._workers
        # A Ctrl-C while the envs close still stops every worker (the finally) before it
        # goes on: the pool is already marked closed, and another close() would do nothing.
        try:
            for w, slot in enumerate(workers):
                if slot.alive:
                    self.submit(w, Close())
            wait_for_exit(workers, timeout)
        finally:
            for slot in workers:
                slot.stop()
            self._shared = None

    def _close_wake(self) -> None:
        """Close the wake-up pipe (under ``_wake_lock``, with no wait() polling it)."""
        if self._wake is not None:
            self._poller.unregister(self._wake[0])
            for fd in self._wake:
                os.close(fd)
            self._wake = None
            self._runnable.close()
