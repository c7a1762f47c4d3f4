"""Whether processes that Ray ends for a pool have ended, and waiting for them to.

A process that has exited stays in the process table, a zombie, until its parent reaps it; the
parent of an actor's process is Ray's raylet, which reaps in its own time (about a second after
``ray.kill`` here). A zombie runs nothing and holds nothing but that entry, so here it counts as
ended: a pool's ``close`` waits for its actors' processes to exit, not for the raylet (psutil's
own wait, which did, kept ``close`` of a node pool 1.2-2.1 s longer than its agents took to
exit).
"""

from __future__ import annotations

import time

import psutil

__all__ = ["alive", "bury", "ended"]

_POLL_MAX = 0.02
"""Seconds at most between two looks at processes that have not ended yet."""


def ended(process: psutil.Process) -> bool:
    """Whether ``process`` has exited (gone, a zombie, or its pid taken by another since)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone meanwhile (an AccessDenied process still runs: is_running)
        return not process.is_running()


def alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (another user's counts; a zombie does
    not)."""
    try:
        return not ended(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _wait(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``processes`` to end; those that have not."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    left = [p for p in processes if not ended(p)]
    while left and time.monotonic() < deadline:
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, _POLL_MAX)
        left = [p for p in left if not ended(p)]
    return left


def bury(processes: list[psutil.Process], timeout: float) -> None:
    """Wait up to ``timeout`` for ``processes`` to end, then kill those still running and wait
    for them as long again."""
    for process in _wait(processes, timeout):
        try:
            process.kill()
        except psutil.Error:
            pass
    _wait(processes, timeout)
