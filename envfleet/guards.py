"""Guards around code envfleet does not control: an env's constructor, reset and step.

What counts as an env's own failure (:func:`env_errors`, widened in a worker process of its own
by :func:`claim_base_exceptions`), and two bounds on an env that hangs: :func:`build_within`
runs a build on a helper thread and abandons it past a deadline (the caller's process, where
nothing can be killed), and :func:`exit_if_longer` ends a worker process of its own past one
(the pool then sees a dead worker, which its own bounds handle).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


_worker_process = False  # set by claim_base_exceptions(): this whole process is a worker
_alarm_dumps_stacks = False  # faulthandler registered on SIGALRM in this process


def claim_base_exceptions() -> None:
    """Declare this process a worker of its own (a worker process, a Ray actor): then any
    ``BaseException`` an env raises, on its main thread too, is that env's failure. Such a
    process ignores SIGINT, so a ``KeyboardInterrupt`` there comes from the env, never from the
    user's Ctrl-C (which the pool's process handles)."""
    global _worker_process
    _worker_process = True
    _take_alarm()


def _stderr_fd() -> int:
    """Where faulthandler writes the stacks: this process's stderr, or descriptor 2 where
    ``sys.stderr`` has no descriptor of its own (pytest's capsys, a notebook's stream)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2


def _take_alarm() -> None:
    """Give SIGALRM, which bounds env rebuilds here (:func:`exit_if_longer`), its default
    action, ending the process once faulthandler has dumped the stacks. A handler inherited
    through fork (pytest-timeout's, a user's) would instead raise inside the env's build."""
    global _alarm_dumps_stacks
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    except ValueError:  # not this process's main thread: exit_if_longer registers on use
        return
    faulthandler.register(signal.SIGALRM, file=_stderr_fd(), all_threads=True, chain=True)
    _alarm_dumps_stacks = True


def env_errors() -> tuple[type[BaseException], ...]:
    """What counts as an env's own failure: any exception, ``SystemExit`` included (an env that
    calls ``sys.exit()`` fails like one that raises); in a worker process (see
    :func:`claim_base_exceptions`) or on any thread but the main one, any ``BaseException`` at
    all (``KeyboardInterrupt``, ``GeneratorExit``, a library's own), which would otherwise end
    a worker that holds other envs. On the caller's main thread (serial backend, the probe) a
    ``KeyboardInterrupt`` is the user's Ctrl-C and is not caught."""
    if not _worker_process and threading.current_thread() is threading.main_thread():
        return (Exception, SystemExit)
    return (BaseException,)


_timers_lock = threading.Lock()
_timers = 0  # blocks inside exit_if_longer now (threads_per_worker: one per thread)


@contextlib.contextmanager
def exit_if_longer(seconds: float | None) -> Iterator[None]:
    """End this process (killed by SIGALRM, the stuck threads' stacks on stderr) if the block
    takes longer than ``seconds`` (``None``: no bound). Only for a worker process of its own:
    the pool then sees a dead worker, which its own bounds handle (restart, ``start_timeout``).

    The bound is the process's real-time interval timer: the kernel delivers SIGALRM, whose
    handler (faulthandler's, in C) dumps every thread's stack and then lets the signal's
    default action end the process, so it fires even while the block holds the GIL. It is one
    per process: blocks on several threads at once share it, re-armed by each.
    ``faulthandler.dump_traceback_later`` is not used: in a worker forked from a process whose
    own faulthandler timer runs (pytest's ``faulthandler_timeout``, a user's watchdog), arming
    it waits for ever for the parent's watchdog thread, which the fork did not copy.
    """
    global _timers, _alarm_dumps_stacks
    if seconds is None:
        yield
        return
    with _timers_lock:
        _timers += 1
        if not _alarm_dumps_stacks:
            faulthandler.register(signal.SIGALRM, file=_stderr_fd(), all_threads=True, chain=True)
            _alarm_dumps_stacks = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        with _timers_lock:
            _timers -= 1
            if not _timers:
                signal.setitimer(signal.ITIMER_REAL, 0)


class Abandoned(TimeoutError):
    """:func:`build_within` gave up waiting (what the build itself raises is never this)."""


def build_within(
    seconds: float,
    build: Callable[[], T],
    discard: Callable[[T], None] | None = None,
    name: str = "envfleet-rebuild",
) -> T:
    """``build()`` on a helper thread, waited for at most ``seconds``: past it
    :class:`Abandoned` (a :class:`TimeoutError`), the stuck thread (a daemon, which cannot be
    stopped) abandoned; should it finish after all, ``discard`` gets what it built. What
    ``build`` raises is raised here."""
    built: list[T] = []
    failed: list[BaseException] = []  # raised again in the waiting thread
    lock = threading.Lock()
    abandoned = False

    def run() -> None:
        try:
            value = build()
        except BaseException as exc:
            with lock:
                failed.append(exc)
            return
        with lock:
            if not abandoned:
                built.append(value)
                return
        if discard is not None:
            discard(value)

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    helper.join(seconds)
    with lock:
        abandoned = not built and not failed
    if abandoned:
        raise Abandoned(
            f"rebuilding the env took longer than start_timeout={seconds:g}s; the thread "
            "building it cannot be stopped and was abandoned"
        )
    if failed:
        raise failed[0]
    return built[0]


__all__ = ["Abandoned", "build_within", "claim_base_exceptions", "env_errors", "exit_if_longer"]
