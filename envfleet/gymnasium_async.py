"""Gymnasium's ``AsyncVectorEnv`` API over the pool's own ``send``/``recv``.

``step_async``/``step_wait``, ``reset_async``/``reset_wait`` and ``call_async``/``call_wait``
let code written for Gymnasium run unchanged on a :class:`~envfleet.Pool`. At most one of them
is pending at a time: its kind is one :class:`PendingCall` (Gymnasium's ``AsyncState``), checked
by one guard on each side (:meth:`GymnasiumAsync._start_call`, :meth:`GymnasiumAsync._end_call`)
that raises Gymnasium's own misuse errors.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envfleet.errors import AlreadyPendingError, NoPendingError
from envfleet.validation import check_options, check_reset_mask

if TYPE_CHECKING:
    from envfleet.dispatch import Dispatch


class PendingCall(enum.Enum):
    """Which of Gymnasium's async calls is pending (its arguments are kept beside it)."""

    NONE = "none"
    STEP = "step"
    RESET = "reset"
    CALL = "call"


class GymnasiumAsync:
    """The ``*_async``/``*_wait`` half of :class:`~envfleet.Pool` (a mixin: the pool gives it
    ``send``, ``reset``, ``call`` and its checks)."""

    _pending_call: PendingCall = PendingCall.NONE
    _pending_args: Any = None

    if TYPE_CHECKING:  # what the pool provides
        num_envs: int
        _all_ids: np.ndarray
        _dispatch: Dispatch

        def _check_usable(self) -> None: ...
        def send(self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None) -> None: ...
        def _results(
            self, env_ids: np.ndarray, *, with_env_id: bool
        ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]: ...
        def _seeds_for(
            self, seed: int | Sequence[int | None] | None, env_ids: np.ndarray, per_env: int
        ) -> list[int | None]: ...
        def reset(
            self,
            *,
            seed: int | Sequence[int | None] | None = None,
            options: dict[str, Any] | None = None,
        ) -> tuple[Any, dict[str, Any]]: ...
        def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]: ...

    def _start_call(self, name: str) -> None:
        """The guard of every ``*_async``: nothing of Gymnasium's may be pending."""
        self._check_usable()
        if self._pending_call is not PendingCall.NONE:
            raise AlreadyPendingError(
                f"{name}() while a step_async, reset_async or call_async is pending: call "
                "step_wait(), reset_wait() or call_wait() first",
                name=name,
            )

    def _end_call(self, kind: PendingCall, name: str, start: str) -> Any:
        """The guard of every ``*_wait``: its ``*_async`` (``start``) must be the one pending.
        Returns the arguments kept for it."""
        self._check_usable()
        if self._pending_call is not kind:
            raise NoPendingError(
                f"{name}() with no {start.partition('(')[0]}() pending: call {start} first",
                name=name,
            )
        args, self._pending_call, self._pending_args = self._pending_args, PendingCall.NONE, None
        return args

    def step_async(self, actions: Any) -> None:
        """``AsyncVectorEnv.step_async``: start stepping every env; :meth:`step_wait` returns
        the results. Code written for Gymnasium runs unchanged (prefer :meth:`send`/:meth:`recv`,
        which also return the first ``batch_size`` envs ready).

        Raises:
            AlreadyPendingError: a ``step_async`` or ``reset_async`` is still pending (a
                ``gymnasium.error.AlreadyPendingCallError``).
        """
        self._start_call("step_async")
        self.send(actions)
        self._pending_call = PendingCall.STEP

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """``AsyncVectorEnv.step_wait``: the results of :meth:`step_async`, as :meth:`step`
        returns them. ``timeout`` is accepted for Gymnasium's signature; the pool's waits are
        bounded by ``step_timeout``.

        Raises:
            NoPendingError: no ``step_async`` is pending (a ``gymnasium.error.NoAsyncCallError``).
        """
        self._end_call(PendingCall.STEP, "step_wait", "step_async(actions)")
        self._dispatch.collect(self._all_ids)
        return self._results(self._all_ids, with_env_id=False)

    def reset_async(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``AsyncVectorEnv.reset_async``: :meth:`reset_wait` resets the envs as
        :meth:`reset` does and returns what it returns (the reset starts there).

        Raises:
            AlreadyPendingError: a ``step_async`` or ``reset_async`` is still pending.
        """
        self._start_call("reset_async")
        # Checked now, as AsyncVectorEnv does: a mistake raises here and leaves nothing pending.
        checked = check_options(options)
        env_ids = self._all_ids
        if checked is not None and "reset_mask" in checked:
            env_ids = np.flatnonzero(check_reset_mask(checked["reset_mask"], self.num_envs))
        self._seeds_for(seed, env_ids, per_env=self.num_envs)
        self._pending_call, self._pending_args = PendingCall.RESET, (seed, options)

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """``AsyncVectorEnv.reset_wait``: the reset that :meth:`reset_async` asked for.

        Raises:
            NoPendingError: no ``reset_async`` is pending (a ``gymnasium.error.NoAsyncCallError``).
        """
        seed, options = self._end_call(PendingCall.RESET, "reset_wait", "reset_async()")
        return self.reset(seed=seed, options=options)

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """``AsyncVectorEnv.call_async``: :meth:`call_wait` calls method ``name`` of every env
        (or reads attribute ``name``) as :meth:`call` does and returns what it returns (the call
        starts there).

        Raises:
            AlreadyPendingError: a ``step_async``, ``reset_async`` or ``call_async`` is still
                pending (a ``gymnasium.error.AlreadyPendingCallError``).
        """
        self._start_call("call_async")
        self._pending_call, self._pending_args = PendingCall.CALL, (name, args, kwargs)

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """``AsyncVectorEnv.call_wait``: the results of the :meth:`call_async` pending, one per
        env. ``timeout`` is accepted for Gymnasium's signature; the pool's waits are bounded by
        ``step_timeout``.

        Raises:
            NoPendingError: no ``call_async`` is pending (a ``gymnasium.error.NoAsyncCallError``).
        """
        name, args, kwargs = self._end_call(PendingCall.CALL, "call_wait", "call_async(name)")
        return self.call(name, *args, **kwargs)
