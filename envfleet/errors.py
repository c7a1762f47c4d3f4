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
    """What the pool does when an env raises, its worker dies or it hangs: ``make(on_error=)``,
    which takes the member or its value (``"raise"``, ``"restart"``).

    Attributes:
        RAISE: the failure is raised as an :class:`EnvError` naming the env, phase and worker;
            the pool is then broken (:class:`BrokenPoolError`) and only ``close()`` is left.
        RESTART: the env that failed (or every env of a worker that died or hung) is built
            again and reset, its episode reported truncated with
            ``infos["envfleet/restarted"]``; past ``max_restarts`` restarts of one env,
            :class:`RestartLimitError` is raised.
    """

    RAISE = "raise"
    RESTART = "restart"


class Phase(enum.Enum):
    """What an environment was doing when it failed: :attr:`EnvError.phase`.

    Attributes:
        MAKE: being built (``make()``, or rebuilt by a restart).
        RESET: ``reset``.
        STEP: ``step`` (an autoreset included).
        CALL: ``call``, ``get_attr`` or ``set_attr``.
        CLOSE: ``close``.
    """

    MAKE = "make"
    RESET = "reset"
    STEP = "step"
    CALL = "call"
    CLOSE = "close"


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker, kept for display: the
    ``__cause__`` of the env's own exception, so that Python prints it under the error.

    Attributes:
        tb: the traceback text, as the worker formatted it.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class RemoteError(Exception):
    """Stands in for a worker exception that could not be pickled or rebuilt in the parent
    (it is then the :class:`EnvError`'s ``__cause__``).

    Attributes:
        type_name: the qualified name of the exception's type in the worker.
        message: its message, or what could be made of it.
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class EnvError(RuntimeError):
    """An environment failed; the pool names which one, where and doing what.

    The base of every env failure: :class:`EnvRaisedError` (the env's code raised),
    :class:`WorkerDiedError` (its worker exited or was killed), :class:`EnvTimeoutError` (it
    hung past ``step_timeout``) and :class:`RestartLimitError`. Under ``on_error="raise"`` the
    pool is unusable after one (:class:`BrokenPoolError`); close it.

    Attributes:
        env_index: global index of the env in the pool (``None`` when a whole worker failed
            before any env could be blamed, or the env failed while ``make()`` first built it
            to read its spaces).
        phase: what the env was doing (:class:`Phase`).
        worker: index of the worker that held the env (``-1``: the caller's process).

    Examples:
        >>> import envfleet
        >>> with envfleet.make("CartPole-v1", 2, backend="serial") as pool:
        ...     try:
        ...         pool.call("no_such_method")
        ...     except envfleet.EnvError as exc:
        ...         print(exc.env_index, exc.phase.value, isinstance(exc, AttributeError))
        0 call True
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
    """The worker holding the env exited or was killed (a segfault, ``os._exit``, the OOM
    killer, a lost node); every env of that worker was lost with it.

    Attributes:
        exitcode: the worker's exit status (negative: the signal that killed it), or ``None``
            where it is not known (a Ray actor, a lost node).
        env_ids: the envs the worker held.
    """

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
    """An env took longer than its bound (``step_timeout`` for a reset, step or call;
    ``start_timeout`` to build): its worker was killed, and is handled as dead."""


class RestartLimitError(EnvError):
    """Under ``on_error="restart"``, an env failed more than ``max_restarts`` times (the last
    failure is ``__cause__``); the pool is then broken."""


class PoolStateError(RuntimeError):
    """Base class for misuse of the pool: a call out of order (``recv`` with nothing sent, a
    ``send`` to an env already in flight, a step before a reset) or after ``close()`` or a
    failure. Raised before anything is sent, naming the envs concerned; each subclass is also
    the ``gymnasium.error`` exception Gymnasium raises in that case."""


class ClosedPoolError(PoolStateError, ClosedEnvironmentError):
    """The pool was used after ``close()`` (a ``gymnasium.error.ClosedEnvironmentError``, as
    Gymnasium's ``AsyncVectorEnv`` raises)."""


class BrokenPoolError(PoolStateError):
    """The pool was used after an env failure left it unusable (``on_error="raise"``, or a
    :class:`RestartLimitError`); only ``close()`` is allowed. The message names the failure."""


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


__all__ = [
    "AlreadyPendingError",
    "BrokenPoolError",
    "ClosedPoolError",
    "EnvError",
    "EnvRaisedError",
    "EnvTimeoutError",
    "NoPendingError",
    "OnError",
    "Phase",
    "PoolStateError",
    "RemoteError",
    "RemoteTraceback",
    "ResetNeededError",
    "RestartLimitError",
    "WorkerDiedError",
    "env_raised_error",
]
