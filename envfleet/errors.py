"""Exceptions raised by envfleet.

Every failure inside an environment reaches the caller as an :class:`EnvError` that names the
env index, the phase (make/reset/step/call/close) and the worker. The original exception, rebuilt
in the parent when it can be unpickled, is the ``__cause__``; its own ``__cause__`` is a
:class:`RemoteTraceback` holding the traceback text from the worker.
"""

from __future__ import annotations

import enum
from typing import Any, cast

from gymnasium.error import (
    AlreadyPendingCallError,
    ClosedEnvironmentError,
    NoAsyncCallError,
    ResetNeeded,
)


class OnError(enum.Enum):
    """What the pool does when an env raises, its worker dies or it hangs."""

    RAISE = "raise"
    RESTART = "restart"


class Phase(enum.Enum):
    """What an environment was doing when it failed."""

    MAKE = "make"
    RESET = "reset"
    STEP = "step"
    CALL = "call"
    CLOSE = "close"


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker, kept for display."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class RemoteError(Exception):
    """Stands in for a worker exception that could not be pickled or rebuilt in the parent."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class EnvError(RuntimeError):
    """An environment failed; the pool names which one, where and doing what.

    Attributes:
        env_index: global index of the env in the pool (``None`` when a whole worker failed
            before any env could be blamed).
        phase: what the env was doing.
        worker: index of the worker that held the env.
    """

    completed: tuple[Any, ...] | None
    """Results of the envs of the failed call that did complete, when the pool could gather
    them: ``(observations, rewards, terminations, truncations, infos)`` with
    ``infos["env_id"]`` naming the envs, as :meth:`Pool.recv` returns them; else ``None``."""

    def __init__(self, message: str, *, env_index: int | None, phase: Phase, worker: int) -> None:
        super().__init__(message)
        self.env_index = env_index
        self.phase = phase
        self.worker = worker
        self.completed = None


class EnvRaisedError(EnvError):
    """The environment code raised an exception (the original is ``__cause__``).

    Raised as an instance of the original's type too (see :func:`env_raised_error`), so an
    ``except ValueError:`` written for Gymnasium's vector envs, which re-raise the env's own
    exception type, still catches it.
    """


def env_raised_error(
    message: str, cause: BaseException, *, env_index: int | None, phase: Phase, worker: int
) -> EnvRaisedError:
    """An :class:`EnvRaisedError` for ``cause`` that is also an instance of ``type(cause)``.

    Gymnasium's ``AsyncVectorEnv`` re-raises an env's exception with its own type (a
    ``ResetNeeded``, an ``AttributeError`` from ``get_attr``, an env's ``AssertionError``); the
    error envfleet raises is of a subclass of both, so code that catches either still works.
    Where no such class can exist (a ``BaseException`` such as ``SystemExit``, a type that
    cannot be subclassed or combined), it is a plain :class:`EnvRaisedError`.
    """
    kind = _raised_error_class(type(cause))
    try:
        error = kind(message, env_index=env_index, phase=phase, worker=worker)
    except Exception:  # an exception type whose constructor needs more than a message
        error = EnvRaisedError(message, env_index=env_index, phase=phase, worker=worker)
    error.__cause__ = cause
    return error


_RAISED_CLASSES: dict[type[BaseException], type[EnvRaisedError]] = {}


def _raised_error_class(kind: type[BaseException]) -> type[EnvRaisedError]:
    """``EnvRaised<Kind>``: a subclass of :class:`EnvRaisedError` and ``kind`` (made once)."""
    made = _RAISED_CLASSES.get(kind)
    if made is None:
        made = _RAISED_CLASSES[kind] = _combine(kind)
    return made


def _combine(kind: type[BaseException]) -> type[EnvRaisedError]:
    if (
        not issubclass(kind, Exception)
        or issubclass(EnvRaisedError, kind)  # Exception, RuntimeError: already one
        or issubclass(kind, EnvError | RemoteError | StopIteration | StopAsyncIteration)
    ):
        return EnvRaisedError
    try:
        combined = type(
            f"EnvRaised{kind.__name__}",
            (EnvRaisedError, kind),
            {
                "__module__": __name__,
                "__doc__": f"An env raised {kind.__qualname__}; see :class:`EnvRaisedError`.",
                "__str__": BaseException.__str__,  # KeyError would quote the message
            },
        )
    except TypeError:  # a final type, or one whose layout or MRO cannot be combined
        return EnvRaisedError
    return cast(type[EnvRaisedError], combined)


class WorkerDiedError(EnvError):
    """The worker process holding the env exited or was killed."""

    def __init__(
        self,
        message: str,
        *,
        env_index: int | None,
        phase: Phase,
        worker: int,
        exitcode: int | None = None,
        env_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, env_index=env_index, phase=phase, worker=worker)
        self.exitcode = exitcode
        self.env_ids = env_ids


class EnvTimeoutError(WorkerDiedError):
    """An env took longer than ``step_timeout``; its worker was killed."""


class RestartLimitError(EnvError):
    """An env failed more than ``max_restarts`` times (the last failure is ``__cause__``)."""


class PoolStateError(RuntimeError):
    """Base class for misuse of the pool's send/recv state machine."""


class ClosedPoolError(PoolStateError, ClosedEnvironmentError):
    """The pool was used after ``close()`` (a ``gymnasium.error.ClosedEnvironmentError``, as
    Gymnasium's ``AsyncVectorEnv`` raises)."""


class BrokenPoolError(PoolStateError):
    """The pool was used after an env failure left it unusable; only ``close()`` is allowed."""


class NoPendingError(PoolStateError, NoAsyncCallError):
    """``recv()`` was called with no env in flight (nothing sent); a
    ``gymnasium.error.NoAsyncCallError``, as Gymnasium's ``step_wait`` raises."""

    def __init__(self, message: str, name: str = "recv") -> None:
        RuntimeError.__init__(self, message)
        self.name = name


class ResetNeededError(PoolStateError, ResetNeeded):
    """An env was stepped before its first reset; a ``gymnasium.error.ResetNeeded``, as a
    Gymnasium env made by ``gymnasium.make`` raises. Nothing was sent: the pool stays usable."""


class AlreadyPendingError(PoolStateError, AlreadyPendingCallError):
    """An action was sent to an env that already has an action (or reset) in flight; a
    ``gymnasium.error.AlreadyPendingCallError``, as Gymnasium's ``step_async`` raises."""

    def __init__(self, message: str, name: str = "send") -> None:
        RuntimeError.__init__(self, message)
        self.name = name
