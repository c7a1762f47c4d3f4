"""How a worker process dies with its pool, whatever state the pool dies in.

A worker whose pool's process is gone must not live on (holding CPU, memory and the envs'
resources). Three lifelines, each covering what the others cannot: EOF on its command pipe
(the worker's loop sees it between commands), the kernel's ``PR_SET_PDEATHSIG`` (Linux: even
while an env holds the GIL in C code) and a watchdog thread (re-parenting, the fork server's
case, platforms without ``prctl``). The worker calls :func:`die_with_parent` first thing.
"""

from __future__ import annotations

import ctypes
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time

PARENT_CHECK_INTERVAL = 1.0
"""Seconds between a worker's checks that its parent is still alive."""


def die_with_parent(parent_pid: int, from_main_thread: bool) -> None:
    """Make this worker end when the pool's process (``parent_pid``) does.

    ``from_main_thread``: the pool started it from its main thread (see :func:`_pdeathsig`).
    """
    if sys.platform.startswith("linux"):
        _pdeathsig(parent_pid, from_main_thread)
    _watch_parent(parent_pid)


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


def _pdeathsig(parent_pid: int, from_main_thread: bool) -> None:
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
