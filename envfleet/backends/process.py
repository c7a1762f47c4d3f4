"""The process backend: worker processes, shared-memory batch arrays, pipes for signalling.

::

    pool (parent)                                   worker w (child process)
    ─────────────                                   ────────────────────────
    write actions into shared rows ──┐
    conn.send(Step(ids)) ────────────┼── pipe ──►   conn.recv() (blocks in the kernel)
                                     │              group.step(ids): envs write obs, rewards,
                                     │              terminations, truncations into their rows
    wait(pipes + process sentinels) ◄┴── pipe ───   conn.send(Reply(infos only if non-empty))
    read rows

Waiting blocks in ``poll``/``read`` on both sides: no spinning, so on a machine with few cores
the envs get every cycle (see ``bench/waiting.py`` for the measurement behind this choice). A
worker that dies wakes the parent through its process sentinel; a worker whose parent dies sees
EOF on its pipe or, if it is stuck inside an env, is stopped by a watchdog thread.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle
import psutil

from envfleet.backends.base import TransportOptions, WorkerLost, deliver
from envfleet.backends.channel import PickledCommands, serve_connection
from envfleet.buffers import SharedBatch
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
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
    conn: Connection,
    parent_end: Connection | None,
    options_blob: bytes,
    shared: SharedBatch,
    parent_pid: int,
    restarts: dict[int, int],
    from_main_thread: bool = False,
) -> None:
    # Ctrl-C goes to the whole process group: the parent alone handles it and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_end is not None:
        parent_end.close()  # so that our recv sees EOF once the parent is gone
    if sys.platform.startswith("linux"):
        _die_with_parent(parent_pid, from_main_thread)
    _watch_parent(parent_pid)
    try:
        # cloudpickle: the env factory may be a lambda or closure, under any start method.
        options: TransportOptions = pickle.loads(options_blob)
    except Exception as exc:  # e.g. the factory's module cannot be imported in this process
        conn.send(Reply(failures=(EnvFailure.capture(None, Phase.MAKE, exc),)))
        return
    group, started = start_group(
        options,
        options.assignment[worker],
        shared.views(),
        ship_observations=shared.observations is None,
        restarts=restarts,
    )
    conn.send(started)
    if group is not None:
        serve_connection(group, conn, SPIN_SECONDS)


class ProcessTransport:
    """One process per worker; the batch arrays live in shared memory."""

    def __init__(self, options: TransportOptions) -> None:
        self._ctx = multiprocessing.get_context(options.context)
        self._shared: SharedBatch | None = SharedBatch.allocate(
            options.observation_space, options.action_space, options.num_envs, self._ctx
        )
        self.batch = self._shared.views()
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        self._alive: list[bool] = []
        self._closed = False
        self._poller: select.poll | None = None
        self._pickled = PickledCommands()
        self._options = options
        self._options_blob = cloudpickle.dumps(options)
        try:
            for worker in range(len(options.assignment)):
                self._start(worker, {})
            self._await_start(range(len(options.assignment)))
        except BaseException:
            self.close(1.0)
            raise

    def _start(self, worker: int, restarts: dict[int, int]) -> None:
        assert self._shared is not None
        parent_end, child_end = self._ctx.Pipe()
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=_worker_main,
            name=f"envfleet-worker-{worker}",
            args=(
                worker,
                child_end,
                parent_end,
                self._options_blob,
                self._shared,
                os.getpid(),
                restarts,
                threading.current_thread() is threading.main_thread(),
            ),
            daemon=True,
        )
        proc.start()
        child_end.close()
        if worker < len(self._procs):
            self._conns[worker], self._procs[worker] = parent_end, proc
            self._alive[worker] = True
        else:
            self._conns.append(parent_end)
            self._procs.append(proc)
            self._alive.append(True)
        if self._poller is not None:
            self._poller.register(parent_end.fileno(), select.POLLIN)
            self._poller.register(proc.sentinel, select.POLLIN)

    def kill(self, worker: int) -> None:
        proc = self._procs[worker]
        if proc.is_alive():
            proc.kill()

    def memory(self, worker: int) -> int | None:
        """Resident memory of ``worker``'s process in bytes (``None``: gone or unknown)."""
        if not self._alive[worker]:
            return None
        try:
            return int(psutil.Process(self._procs[worker].pid).memory_info().rss)
        except (psutil.Error, ValueError):
            return None

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        old_conn, old_proc = self._conns[worker], self._procs[worker]
        if self._alive[worker] and self._poller is not None:  # replaced alive (recycled)
            self._poller.unregister(old_conn.fileno())
            self._poller.unregister(old_proc.sentinel)
        self._alive[worker] = False
        if old_proc.is_alive():
            old_proc.kill()
        old_proc.join(1.0)
        old_conn.close()
        old_proc.close()
        self._start(worker, restarts)
        self._await_start([worker])

    def _await_start(self, workers: Sequence[int]) -> None:
        """Wait for each of ``workers`` to report its envs built.

        Only their own pipes and sentinels are watched: when one worker is restarted mid-run,
        the other workers' replies stay in their pipes for the pool's next wait.
        """
        options = self._options
        deadline = time.monotonic() + options.start_timeout
        for worker in workers:
            conn, proc = self._conns[worker], self._procs[worker]
            reply: Reply | None = None
            lost = False
            remaining = max(0.0, deadline - time.monotonic())
            if not multiprocessing.connection.wait([conn, proc.sentinel], remaining):
                proc.kill()  # still building its envs: a constructor that hangs
                proc.join(1.0)
                raise EnvTimeoutError(
                    f"worker {worker} did not build its envs {list(options.assignment[worker])} "
                    f"within start_timeout={options.start_timeout:g}s; killed",
                    env_index=None,
                    phase=Phase.MAKE,
                    worker=worker,
                    exitcode=proc.exitcode,
                    env_ids=tuple(options.assignment[worker]),
                )
            try:
                if conn.poll():
                    reply = conn.recv()
                else:
                    lost = True
            except (EOFError, OSError):
                lost = True
            if lost:
                proc.join(1.0)
                raise WorkerDiedError(
                    f"worker {worker} died while building its envs "
                    f"{list(options.assignment[worker])} ({_describe_exit(proc.exitcode)})",
                    env_index=None,
                    phase=Phase.MAKE,
                    worker=worker,
                    exitcode=proc.exitcode,
                    env_ids=tuple(options.assignment[worker]),
                )
            if reply is not None and reply.failures:
                raise reply.failures[0].to_error(worker, options.spec.name)

    def prepare(self, worker: int, command: Command) -> None:
        """Pickle ``command`` now (kept for :meth:`submit`): what cannot travel fails here."""
        self._pickled.dumps(command)

    def submit(self, worker: int, command: Command) -> None:
        try:
            self._conns[worker].send_bytes(self._pickled.dumps(command))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass  # the worker is gone; its sentinel reports it on the next wait

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        if self._poller is None:
            self._poller = select.poll()
            for w, alive in enumerate(self._alive):
                if alive:
                    self._poller.register(self._conns[w].fileno(), select.POLLIN)
                    self._poller.register(self._procs[w].sentinel, select.POLLIN)
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        events: list[tuple[int, int]] = []
        if SPIN_SECONDS > 0 and timeout != 0:
            deadline = time.perf_counter() + SPIN_SECONDS
            while not events and time.perf_counter() < deadline:
                events = self._poller.poll(0)
        if not events:
            events = _retry_eintr(self._poller.poll, ms)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        if not events:
            return replies
        ready = {fd for fd, _ in events}
        for w, alive in enumerate(self._alive):
            if not alive:
                continue
            conn, proc = self._conns[w], self._procs[w]
            died = proc.sentinel in ready
            if conn.fileno() in ready and not died:
                # One message per wake-up: poll() says more are there on the next call, which
                # costs less than Connection.poll (a new selector per call).
                try:
                    reply = conn.recv()
                    if reply is not None and reply.observations:  # pickled: into the batch
                        deliver(self.batch, self._options.observation_space, reply)
                    replies.append((w, reply))
                except (EOFError, OSError):
                    died = True
            elif died:  # replies it sent before dying come first
                try:
                    while conn.poll():
                        reply = conn.recv()
                        if reply is not None and reply.observations:
                            deliver(self.batch, self._options.observation_space, reply)
                        replies.append((w, reply))
                except (EOFError, OSError):
                    pass
            if died:
                proc.join(1.0)
                self._alive[w] = False
                self._poller.unregister(conn.fileno())
                self._poller.unregister(proc.sentinel)
                replies.append((w, WorkerLost(proc.exitcode, _describe_exit(proc.exitcode))))
        return replies

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        for w, alive in enumerate(self._alive):
            if alive:
                self.submit(w, Close())
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in self._procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # Drain replies so that no worker blocks writing to a full pipe while exiting.
            handles: list[Any] = [
                c for c, p in zip(self._conns, self._procs, strict=True) if p.is_alive()
            ]
            handles += [p.sentinel for p in self._procs if p.is_alive()]
            for handle in multiprocessing.connection.wait(handles, min(remaining, 0.1)):
                if isinstance(handle, Connection):
                    try:
                        handle.recv()
                    except (EOFError, OSError):
                        pass
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
            proc.close()
        for conn in self._conns:
            conn.close()
        self._alive = [False] * len(self._alive)
        self._shared = None


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
