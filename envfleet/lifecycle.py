"""Lifecycle: whether a pool may be used, and its one close.

A pool may be used while it is open, in the process that made it, and not broken by an earlier
failure. :meth:`Lifecycle.check` is the first thing every entry point of the face and of its
collaborators calls; it raises :class:`~envfleet.ClosedPoolError` or
:class:`~envfleet.BrokenPoolError` otherwise. :meth:`Lifecycle.close` closes the pool's
dispatch once, whoever asks (the caller, a ``with`` block, ``__del__``, another thread).

A child forked while pools are open inherits them, workers and memory of its parent: each is
marked closed there without touching them (:func:`_forked`), so that the child's ``close()``,
garbage collection or exit cannot stop the parent's workers (they used to be sent Close, and
SIGTERM).
"""

from __future__ import annotations

import os
import weakref

from envfleet.dispatch import Dispatch
from envfleet.errors import AlreadyPendingError, BrokenPoolError, ClosedPoolError
from envfleet.recovery import Recovery
from envfleet.recycling import Recycler
from envfleet.validation import check_close_timeout

DEFAULT_CLOSE_TIMEOUT = 5.0
"""Seconds ``close()`` lets envs close cleanly before their workers are terminated."""


class Lifecycle:
    """One pool as a whole: open, closed or broken.

    Args:
        env_name: the env's name, for errors.
        dispatch: the pool's dispatch (closed with the pool).
        recovery: the pool's recovery (the failure that broke the pool, if one did).
    """

    def __init__(self, env_name: str, dispatch: Dispatch, recovery: Recovery) -> None:
        self.closed = False
        self.owner_pid = os.getpid()
        self._env_name = env_name
        self._dispatch = dispatch
        self._recovery = recovery
        self.rolling_out = False
        """Whether parts of an asynchronous rollout are out (or in, not handed over): only
        rollouts may be started or waited for then."""
        self.memory = Recycler(shared=True)
        """The pool's large arrays (its rollouts'), their memory used again once dropped;
        none kept after the close. Shared memory: a process worker records its part of a
        rollout straight into it (:mod:`envfleet.shared_records`)."""
        _LIVE.add(self)

    def check(self, rollouts: bool = False) -> None:
        """Raise unless the pool may be used: open, in its owner's process, not broken, and
        (unless the caller is a rollout's, ``rollouts``) no asynchronous rollout pending."""
        if self.closed:
            if self.owner_pid != os.getpid():
                raise ClosedPoolError(
                    f"this pool of {self._env_name} belongs to the process that made it (pid "
                    f"{self.owner_pid}); a forked child cannot use it: make one in the child"
                )
            raise ClosedPoolError(f"this pool of {self._env_name} is closed")
        broken = self._recovery.broken
        if broken is not None:
            raise BrokenPoolError(
                f"this pool of {self._env_name} is broken by an earlier failure "
                f"({broken}); close() it and make a new one"
            ) from broken
        if self.rolling_out and not rollouts:
            raise AlreadyPendingError(
                f"this pool of {self._env_name} has an asynchronous rollout pending: "
                "rollout_wait() its parts before a step, reset or call",
                name="rollout_async",
            )

    def close(self, timeout: float | None) -> None:
        """Stop every worker, letting envs close for ``timeout`` seconds (``None``: the
        default bound); once: a closed pool returns at once, whatever ``timeout`` is."""
        if self.closed:
            return
        timeout = check_close_timeout(timeout, DEFAULT_CLOSE_TIMEOUT)
        self.closed = True
        self.memory.clear()
        self._dispatch.close(timeout)

    def dropped(self) -> None:
        """The pool was dropped unclosed (its ``__del__``): closed within a second, quietly."""
        try:
            self.close(timeout=1.0)
        except Exception:
            pass

    def forked(self) -> None:
        """In a forked child: closed, without touching the parent's workers."""
        self.closed = True
        self._dispatch.forked()


_LIVE: weakref.WeakSet[Lifecycle] = weakref.WeakSet()
"""The lifecycle of every open pool of this process, for :func:`_forked`."""


def _forked() -> None:
    """In a forked child, the pools inherited are their parent's (its workers, its memory):
    each is closed here without touching them."""
    for life in list(_LIVE):
        life.forked()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


__all__ = ["DEFAULT_CLOSE_TIMEOUT", "Lifecycle"]
