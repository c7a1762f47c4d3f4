"""Gymnasium's ``AsyncVectorEnv`` API over the pool's own ``send``/``recv``.

``step_async``/``step_wait``, ``reset_async``/``reset_wait`` and ``call_async``/``call_wait``
let code written for Gymnasium run unchanged on a :class:`~envfleet.Pool`. The pool holds one
:class:`GymnasiumAsync` and hands these calls to it. At most one of them is pending at a time:
its kind is one :class:`PendingCall` (Gymnasium's ``AsyncState``), kept with its arguments and
checked by one guard on each side (:meth:`GymnasiumAsync._start`, :meth:`GymnasiumAsync._end`)
that raises Gymnasium's own misuse errors.

``reset_wait`` and ``call_wait`` are the pool's ``reset`` and ``call``, and ``step_async`` its
``send``: this object reaches the face's public API through a :func:`weakref.proxy` (it holds
no strong reference to it, so that a pool dropped unclosed still closes at once, in its
``__del__``), and ``step_wait`` collects the step through the pool's exchange.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from envfleet.episodes import Episodes
from envfleet.errors import AlreadyPendingError, NoPendingError
from envfleet.exchange import Exchange
from envfleet.lifecycle import Lifecycle
from envfleet.results import Results
from envfleet.validation import check_options, check_reset_mask


class PendingCall(enum.Enum):
    """Which of Gymnasium's async calls is pending (its arguments are kept beside it)."""

    NONE = "none"
    STEP = "step"
    RESET = "reset"
    CALL = "call"


class Face(Protocol):
    """What :class:`GymnasiumAsync` uses of the pool: its public API."""

    copy: bool

    def send(self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None) -> None: ...
    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]: ...
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]: ...


class GymnasiumAsync:
    """The ``*_async``/``*_wait`` calls of one pool, their pending call and its arguments.

    Args:
        face: the pool (held weakly): its ``send``, ``reset``, ``call`` and ``copy``.
        life: the pool's lifecycle (the first check of every call).
        episodes: the pool's seeds, checked by ``reset_async``.
        exchange: the pool's exchange, which ``step_wait`` collects the step through.
    """

    def __init__(self, face: Face, life: Lifecycle, episodes: Episodes, exchange: Exchange) -> None:
        self._face: Face = weakref.proxy(face)
        self._life = life
        self._episodes = episodes
        self._exchange = exchange
        self.pending = PendingCall.NONE
        """The call pending."""
        self.args: Any = None
        """The arguments kept for the pending call's ``*_wait``."""

    def _start(self, name: str) -> None:
        """The guard of every ``*_async``: nothing of Gymnasium's may be pending."""
        self._life.check()
        if self.pending is not PendingCall.NONE:
            raise AlreadyPendingError(
                f"{name}() while a step_async, reset_async or call_async is pending: call "
                "step_wait(), reset_wait() or call_wait() first",
                name=name,
            )

    def _end(self, kind: PendingCall, name: str, start: str) -> Any:
        """The guard of every ``*_wait``: its ``*_async`` (``start``) must be the one pending.
        Returns the arguments kept for it."""
        self._life.check()
        if self.pending is not kind:
            raise NoPendingError(
                f"{name}() with no {start.partition('(')[0]}() pending: call {start} first",
                name=name,
            )
        args, self.pending, self.args = self.args, PendingCall.NONE, None
        return args

    def step_async(self, actions: Any) -> None:
        """``Pool.step_async``: the pool's ``send`` of every env, pending until ``step_wait``."""
        self._start("step_async")
        self._face.send(actions)
        self.pending = PendingCall.STEP

    def step_wait(self) -> Results:
        """``Pool.step_wait``: every env's results, as ``step`` returns them."""
        self._end(PendingCall.STEP, "step_wait", "step_async(actions)")
        return self._exchange.wait_all(self._face.copy)

    def reset_async(
        self, seed: int | Sequence[int | None] | None, options: dict[str, Any] | None
    ) -> None:
        """``Pool.reset_async``: the arguments checked and kept for ``reset_wait``."""
        self._start("reset_async")
        # Checked now, as AsyncVectorEnv does: a mistake raises here and leaves nothing pending.
        checked = check_options(options)
        episodes = self._episodes
        env_ids = np.arange(episodes.num_envs)
        if checked is not None and "reset_mask" in checked:
            env_ids = np.flatnonzero(check_reset_mask(checked["reset_mask"], episodes.num_envs))
        episodes.seeds(seed, env_ids, per_env=episodes.num_envs)
        self.pending, self.args = PendingCall.RESET, (seed, options)

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        """``Pool.reset_wait``: the pool's ``reset`` with the arguments kept."""
        seed, options = self._end(PendingCall.RESET, "reset_wait", "reset_async()")
        return self._face.reset(seed=seed, options=options)

    def call_async(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``Pool.call_async``: the call kept for ``call_wait``."""
        self._start("call_async")
        self.pending, self.args = PendingCall.CALL, (name, args, kwargs)

    def call_wait(self) -> tuple[Any, ...]:
        """``Pool.call_wait``: the pool's ``call`` with the arguments kept."""
        name, args, kwargs = self._end(PendingCall.CALL, "call_wait", "call_async(name)")
        return self._face.call(name, *args, **kwargs)


__all__ = ["Face", "GymnasiumAsync", "PendingCall"]
