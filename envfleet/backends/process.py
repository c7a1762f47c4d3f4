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
byte protocol of :mod:`envfleet.backends.channel`: the whole-pool step, sent every step,
is one byte each way, with no pickling on either side. A synchronous step asks :meth:`wait`
for every pending reply (``want``): it keeps polling, within the pool's bound, until they are
all in, so the pool takes them in one go rather than one wake-up per worker.

Waiting blocks in ``poll``/``read`` on both sides: no spinning, so on a machine with few cores
the envs get every cycle (see ``bench/waiting.py`` for the measurement behind this choice). A
worker that dies wakes the parent through its process sentinel (a reply it had half written is
dropped); a worker whose parent dies sees EOF on its command pipe, is killed by the kernel
(``PR_SET_PDEATHSIG``) or, failing both, is stopped by a watchdog thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import cloudpickle

from envfleet.backends.base import BaseTransport, TransportOptions, WorkerLost
from envfleet.backends.channel import (
    REPEAT_BYTES,
    FrameReader,
    PickledCommands,
    encode_reply,
    frame,
    serve_pipes,
    write_all,
)
from envfleet.backends.rows import Shipping, deliver
from envfleet.backends.shm import batch_allocator
from envfleet.buffers import SharedBatch
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.group import claim_base_exceptions
from envfleet.protocol import Close, Command, EnvFailure, Reply
from envfleet.worker import start_group

PARENT_CHECK_INTERVAL = 1.0
"""Seconds between a worker's checks that its parent is still alive."""

SPIN_SECONDS = 0.0
"""How long each side polls without sleeping before it blocks in the kernel.

0 (block at once) measured fastest on 2 cores, where a spinning parent or worker takes the core
an env needs: see ``bench/waiting.py``. Raise it only with more cores than busy processes.
"""


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the parent dies, even if an env is stuck in C code."""

    # Under forkserver our parent is the fork server, which outlives nothing of ours: watch the
    # pool's process itself, and being re-parented.
    first_parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_INTERVAL)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass  # alive, only not ours to signal
            if os.getppid() != first_parent:
                os._exit(1)

    threading.Thread(target=watch, name="envfleet-parent-watch", daemon=True).start()


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, from_main_thread: bool) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux).

    The watchdog thread cannot run while an env holds the GIL (a long regex, say); the kernel
    needs no thread of ours. The signal follows the death of the *thread* that started us: it is
    asked for only when that is the pool's main thread (fork, spawn), or the fork server
    (forkserver: single-threaded, and it exits with the pool's process).
    """
    parent = os.getppid()
    if parent == parent_pid and not from_main_thread:
        return  # started from a thread that may end before the pool: the watchdog only
    if parent != parent_pid:
        # Started by the fork server, which exits once every holder of its "alive" pipe has
        # closed it: the pool's process, and each of its children. Let go of our copy, or the
        # fork server (and so this worker) would outlive the pool.
        server = multiprocessing.forkserver._forkserver
        alive = getattr(server, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(
    worker: int,
    commands: Connection,
    replies: Connection,
    parent_ends: tuple[Connection, Connection] | None,
    options_blob: bytes,
    shared: SharedBatch,
    parent_pid: int,
    restarts: dict[int, int],
    from_main_thread: bool = False,
) -> None:
    # Ctrl-C goes to the whole process group: the parent alone handles it and closes us. So a
    # KeyboardInterrupt here is an env's own, its failure like any other exception.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    claim_base_exceptions()
    if parent_ends is not None:
        for end in parent_ends:
            end.close()  # so that our read sees EOF once the parent is gone
    if sys.platform.startswith("linux"):
        _die_with_parent(parent_pid, from_main_thread)
    _watch_parent(parent_pid)
    reply_fd = replies.fileno()
    try:
        # cloudpickle: the env factory may be a lambda or closure, under any start method.
        options: TransportOptions = pickle.loads(options_blob)
    except Exception as exc:  # e.g. the factory's module cannot be imported in this process
        write_all(
            reply_fd, encode_reply(Reply(failures=(EnvFailure.capture(None, Phase.MAKE, exc),)))
        )
        return
    batch = shared.views()
    group, started = start_group(
        options,
        options.assignment[worker],
        batch,
        restarts=restarts,
        rebuild_timeout=options.start_timeout,  # a process of our own: it may end itself
    )
    write_all(reply_fd, encode_reply(started))
    if group is None:
        return
    if shared.observations is None:  # a space shared memory cannot hold: they travel pickled
        group = Shipping(group, batch, options.observation_space)
    serve_pipes(group, commands.fileno(), reply_fd, SPIN_SECONDS)


class ProcessTransport(BaseTransport):
    """One process per worker; the batch arrays live in shared memory."""

    def __init__(self, options: TransportOptions) -> None:
        self._ctx = multiprocessing.get_context(options.context)
        spaces = options.observation_space, options.action_space, options.num_envs
        self._shared: SharedBatch | None = SharedBatch.allocate(
            *spaces, batch_allocator(self._ctx, SharedBatch.nbytes(*spaces))
        )
        self.batch = self._shared.views()
        self._ends: list[tuple[Connection, Connection]] = []  # (command writer, reply reader)
        self._command_fds: list[int] = []
        # Per worker: bytes of commands the command pipe had no room for yet (a large command
        # to a worker busy with an earlier one); written as the pipe drains, within wait().
        self._outbox: list[bytearray] = []
        self._writing: set[int] = set()  # workers whose command pipe the poller watches
        self._reply_fds: list[int] = []
        self._readers: list[FrameReader] = []
        self._last: list[Command | None] = []  # the command each worker would repeat
        self._procs: list[BaseProcess] = []
        self._sentinels: list[int] = []  # each process's sentinel (read on every wait)
        self._alive: list[bool] = []
        self._closed = False
        self._poller: select.poll | None = None
        self._pickled = PickledCommands()
        self._options = options
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
        command_r, command_w = self._ctx.Pipe(duplex=False)
        reply_r, reply_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=_worker_main,
            name=f"envfleet-worker-{worker}",
            args=(
                worker,
                command_r,
                reply_w,
                (command_w, reply_r),
                self._options_blob,
                self._shared,
                os.getpid(),
                restarts,
                threading.current_thread() is threading.main_thread(),
            ),
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:
            for end in (command_r, command_w, reply_r, reply_w):
                end.close()
            raise
        command_r.close()
        reply_w.close()  # so that the worker's death reads as EOF here
        os.set_blocking(reply_r.fileno(), False)
        # A write never blocks the pool: what does not fit waits in the worker's outbox, so a
        # hung worker cannot hold up a submit beyond step_timeout (nor deadlock against a
        # worker blocked writing a large reply).
        os.set_blocking(command_w.fileno(), False)
        slot = (
            (command_w, reply_r),
            command_w.fileno(),
            bytearray(),
            reply_r.fileno(),
            FrameReader(),
            None,
            proc,
            proc.sentinel,
            True,
        )
        lists = (
            self._ends,
            self._command_fds,
            self._outbox,
            self._reply_fds,
            self._readers,
            self._last,
            self._procs,
            self._sentinels,
            self._alive,
        )
        replace = worker < len(self._procs)
        for values, value in zip(lists, slot, strict=True):
            if replace:
                values[worker] = value  # type: ignore[index]
            else:
                values.append(value)  # type: ignore[attr-defined]
        if self._poller is not None:
            self._poller.register(reply_r.fileno(), select.POLLIN)
            self._poller.register(proc.sentinel, select.POLLIN)

    def forked(self) -> None:
        """In a forked child: the workers are the parent's. multiprocessing's exit handler
        would terminate them as this process's daemonic children (its ``_children`` is
        inherited through ``os.fork``); they are taken out of it."""
        children = getattr(multiprocessing.process, "_children", None)
        if isinstance(children, set):
            children.difference_update(self._procs)

    def kill(self, worker: int) -> None:
        proc = self._procs[worker]
        if proc.is_alive():
            proc.kill()

    def memory(self, worker: int) -> int | None:
        """Resident memory of ``worker``'s process in bytes (``None``: gone or unknown)."""
        if not self._alive[worker]:
            return None
        import psutil  # only worker_memory_limit asks: `make` alone does not import it

        try:
            return int(psutil.Process(self._procs[worker].pid).memory_info().rss)
        except (psutil.Error, ValueError):
            return None

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        old_proc = self._procs[worker]
        if self._alive[worker] and self._poller is not None:  # replaced alive (recycled)
            self._poller.unregister(self._reply_fds[worker])
            self._poller.unregister(old_proc.sentinel)
        self._alive[worker] = False
        self._drop_outbox(worker)
        if old_proc.is_alive():
            old_proc.kill()
        old_proc.join(1.0)
        for end in self._ends[worker]:
            end.close()
        old_proc.close()
        with sigint_held():
            self._start(worker, restarts)
        self._await_start([worker])

    def _read(self, worker: int, out: list[Reply | None]) -> bool:
        """Read what ``worker``'s reply pipe holds into ``out``; False at EOF (it is gone)."""
        fd, reader = self._reply_fds[worker], self._readers[worker]
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            reader.feed(data, out)
            if len(data) < 1 << 16:
                return True

    def _start_failed(self, kind: type[WorkerDiedError], worker: int, what: str) -> WorkerDiedError:
        """The error for ``worker`` that could not build its envs (``what`` happened)."""
        return kind(
            f"worker {worker} {what}",
            env_index=None,
            phase=Phase.MAKE,
            worker=worker,
            exitcode=self._procs[worker].exitcode,
            env_ids=tuple(self._options.assignment[worker]),
        )

    def _await_start(self, workers: Sequence[int]) -> None:
        """Wait for each of ``workers`` to report its envs built.

        Only their own pipes and sentinels are watched: when one worker is restarted mid-run,
        the other workers' replies stay in their pipes for the pool's next wait.
        """
        options = self._options
        deadline = time.monotonic() + options.start_timeout
        for worker in workers:
            fd, proc = self._reply_fds[worker], self._procs[worker]
            got: list[Reply | None] = []
            lost = False
            while not got and not lost:
                remaining = max(0.0, deadline - time.monotonic())
                ready = multiprocessing.connection.wait([fd, proc.sentinel], remaining)
                if not ready:
                    proc.kill()  # still building its envs: a constructor that hangs
                    proc.join(1.0)
                    raise self._start_failed(
                        EnvTimeoutError,
                        worker,
                        f"did not build its envs {list(options.assignment[worker])} "
                        f"within start_timeout={options.start_timeout:g}s; killed",
                    )
                lost = not self._read(worker, got)
            if not got:
                proc.join(1.0)
                raise self._start_failed(
                    WorkerDiedError,
                    worker,
                    f"died while building its envs {list(options.assignment[worker])} "
                    f"({_describe_exit(proc.exitcode)})",
                )
            reply = got[0]
            if reply is not None and reply.failures:
                raise reply.failures[0].to_error(worker, options.spec.name)

    def prepare(self, worker: int, command: Command) -> None:
        """Pickle ``command`` now (kept for :meth:`submit`): what cannot travel fails here."""
        self._pickled.dumps(command)

    def submit(self, worker: int, command: Command) -> None:
        if command is self._last[worker]:
            data = REPEAT_BYTES
        else:
            data = frame(self._pickled.dumps(command))
            self._last[worker] = command
        outbox = self._outbox[worker]
        if outbox:  # earlier bytes still wait for room: these go after them
            outbox += data
            return
        fd = self._command_fds[worker]
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            written = 0
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return  # the worker is gone; its sentinel reports it on the next wait
        if written < len(data):
            outbox += data[written:]
            self._watch_outbox(worker)

    def _watch_outbox(self, worker: int) -> None:
        if self._poller is not None and self._alive[worker] and worker not in self._writing:
            self._poller.register(self._command_fds[worker], select.POLLOUT)
            self._writing.add(worker)

    def _unwatch_outbox(self, worker: int) -> None:
        if worker in self._writing:
            self._writing.discard(worker)
            if self._poller is not None:
                self._poller.unregister(self._command_fds[worker])

    def _flush(self, worker: int) -> None:
        """Write what ``worker``'s outbox holds, as far as its command pipe has room."""
        outbox, fd = self._outbox[worker], self._command_fds[worker]
        try:
            while outbox:
                written = os.write(fd, outbox)
                del outbox[:written]
        except BlockingIOError:
            return
        except OSError:  # the worker is gone: its sentinel reports it
            outbox.clear()
        self._unwatch_outbox(worker)

    def _drop_outbox(self, worker: int) -> None:
        """Forget what was never written to ``worker`` (lost or replaced)."""
        self._outbox[worker].clear()
        self._unwatch_outbox(worker)

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        """Replies that have arrived, waiting up to ``timeout`` for the first.

        Keeps waiting (within ``timeout``) until ``want`` replies are in, a worker is lost or a
        reply reports a failure, so that a synchronous step is taken in one go.
        """
        if self._poller is None:
            self._poller = select.poll()
            for w, alive in enumerate(self._alive):
                if alive:
                    self._poller.register(self._reply_fds[w], select.POLLIN)
                    self._poller.register(self._procs[w].sentinel, select.POLLIN)
                    if self._outbox[w]:
                        self._watch_outbox(w)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        while True:
            events: list[tuple[int, int]] = []
            if SPIN_SECONDS > 0 and ms != 0:
                spin_until = time.perf_counter() + SPIN_SECONDS
                while not events and time.perf_counter() < spin_until:
                    events = self._poller.poll(0)
            if not events:
                events = _retry_eintr(self._poller.poll, ms)
            if events:
                start = len(replies)
                ready = {fd for fd, _ in events}
                if any(self._outbox):
                    for w, outbox in enumerate(self._outbox):
                        if outbox and self._command_fds[w] in ready:
                            self._flush(w)
                if self._take_events(ready, replies):
                    return replies  # a worker was lost: the pool sees to it first
                for _, reply in replies[start:]:
                    if reply is not None and reply.failures:  # type: ignore[union-attr]
                        return replies  # a failure is raised at once, not after the rest
            if len(replies) >= want or timeout == 0:
                return replies
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return replies
                ms = math.ceil(left * 1000)

    def _take_events(
        self, ready: set[int], replies: list[tuple[int, Reply | WorkerLost | None]]
    ) -> bool:
        """Read the replies of the workers ``ready`` names; True if one of them is lost."""
        lost = False
        got: list[Reply | None] = []
        reply_fds, sentinels = self._reply_fds, self._sentinels
        for w, alive in enumerate(self._alive):
            if not alive:
                continue
            fd = reply_fds[w]
            died = sentinels[w] in ready
            if fd in ready or died:  # replies it sent before dying come first
                if not self._read(w, got):
                    died = True
                if got:
                    for reply in got:
                        if reply is not None and reply.rows is not None:  # into the batch
                            deliver(self.batch, self._options.observation_space, reply)
                    replies.extend([(w, reply) for reply in got])
                    got.clear()
            if died:
                proc = self._procs[w]
                if proc.is_alive():  # EOF without an exit: give it a moment to finish dying
                    proc.join(1.0)
                    if proc.is_alive():
                        proc.kill()
                proc.join(1.0)
                self._read(w, got)  # what came between the first read and the exit
                replies.extend([(w, reply) for reply in got])
                got.clear()
                self._alive[w] = False
                self._drop_outbox(w)
                self._poller.unregister(fd)  # type: ignore[union-attr]
                self._poller.unregister(proc.sentinel)  # type: ignore[union-attr]
                replies.append((w, WorkerLost(proc.exitcode, _describe_exit(proc.exitcode))))
                lost = True
        return lost

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        # A Ctrl-C while the envs close still stops every worker (the finally) before it
        # goes on: the pool is already marked closed, and another close() would do nothing.
        try:
            for w, alive in enumerate(self._alive):
                if alive:
                    self.submit(w, Close())
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in self._procs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for w, outbox in enumerate(self._outbox):
                    if outbox and self._alive[w]:
                        self._flush(w)  # the Close queued behind a large command
                # Drain replies so that no worker blocks writing to a full pipe while exiting.
                handles: list[Any] = [
                    fd for fd, p in zip(self._reply_fds, self._procs, strict=True) if p.is_alive()
                ]
                handles += [p.sentinel for p in self._procs if p.is_alive()]
                for handle in multiprocessing.connection.wait(handles, min(remaining, 0.1)):
                    if handle in self._reply_fds:
                        try:
                            while os.read(handle, 1 << 16):
                                pass
                        except OSError:
                            pass
        finally:
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(1.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(1.0)
                try:
                    proc.close()
                except ValueError:  # reaped by a wait of another thread (close() from a thread)
                    pass
            for ends in self._ends:
                for end in ends:
                    end.close()
            self._alive = [False] * len(self._alive)
            self._shared = None


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C that lands in the block and deliver it after, to the handler it was for.

    Python runs its fork hooks (``threading``'s, ``logging``'s, anyone's) with any exception of
    theirs "ignored": a KeyboardInterrupt raised by a Ctrl-C landing in one is printed and
    dropped, and the program goes on. Workers are started in this block, where the SIGINT
    handler only notes the signal; the caller's handler runs once they are all recorded, so the
    pool can stop them. (A signal mask would not do: the kernel may hand SIGINT to another
    thread, and Python runs the handler on the main thread, in a fork hook all the same.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Python's handlers run on the main thread only: not in this thread's fork hooks
        return
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # SIG_IGN, SIG_DFL, or not set from Python
        yield
        return
    held: list[FrameType | None] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if held:
            handler(signal.SIGINT, held[0])


def _retry_eintr(poll: Any, ms: int | None) -> list[tuple[int, int]]:
    while True:
        try:
            return poll(ms)  # type: ignore[no-any-return]
        except InterruptedError:  # pragma: no cover - PEP 475 retries already
            continue


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def open_transport(options: TransportOptions) -> ProcessTransport:
    return ProcessTransport(options)
