"""How a worker process dies with its pool, whatever state the pool dies in.

A worker whose pool's process is gone must not live on (holding CPU, memory and the envs'
resources). Three lifelines, each covering what the others cannot: EOF on its command pipe
(the worker's loop sees it between commands), the kernel's ``PR_SET_PDEATHSIG`` (Linux: even
while an env holds the GIL in C code) and a watchdog thread (re-parenting, the fork server's
case, platforms without ``prctl``). The worker calls :func:`die_with_parent` first thing.

And the other way: a Ctrl-C that lands while the pool starts workers is held until they are
all recorded (:func:`sigint_held`), so that the pool can stop every one of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

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


__all__ = ["PARENT_CHECK_INTERVAL", "die_with_parent", "sigint_held"]
