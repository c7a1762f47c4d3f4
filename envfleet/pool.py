"""Pool: the ``gymnasium.vector.VectorEnv`` users hold, over any backend.

The face: the API users call, with its docstrings; each call goes to the part that owns it and
its state (:mod:`envfleet.pool_parts` wires them). None holds the face strongly: a pool
dropped unclosed closes at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from envfleet.backends import Transport
from envfleet.backends.contract.registry import TransportKind, refusal
from envfleet.errors import OnError
from envfleet.ledger import EnvState
from envfleet.lifecycle import DEFAULT_CLOSE_TIMEOUT
from envfleet.pool_parts import Parts
from envfleet.recovery import DEFAULT_MAX_RESTARTS
from envfleet.rollouts import Policy, Rollout
from envfleet.stats import PoolStats
from envfleet.validation import check_memory_limit


class Pool(VectorEnv):
    """Many copies of an environment stepped in parallel; build one with :func:`envfleet.make`.

    Attributes:
        num_envs: number of envs.
        batch_size: envs returned by each :meth:`recv` (``num_envs`` in sync mode).
        autoreset_mode: Gymnasium's autoreset mode the envs follow.
        copy: whether observations are returned as copies (the default) or, when the envs
            returned are consecutive and in order (sync ``step`` and ``reset``; one worker's
            block in an async batch), as views of the batch arrays, which their next step
            overwrites (Gymnasium's ``copy``).
        check_actions: whether each action is checked against the action space before it is
            sent (``make(check_actions=True)``); by default only the batch's shape is.

    Examples:
        >>> import envfleet  # Gymnasium's loop
        >>> with envfleet.make("CartPole-v1", num_envs=4, num_workers=2, seed=0) as pool:
        ...     obs, infos = pool.reset()
        ...     obs, rewards, terminations, truncations, infos = pool.step([0, 1, 0, 1])
        >>> obs.shape, pool.num_workers
        ((4, 4), 2)
    """

    def __init__(
        self,
        transport: Transport,
        assignment: Sequence[tuple[int, ...]],
        *,
        backend: TransportKind,
        env_name: str,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        metadata: dict[str, Any],
        render_mode: str | None,
        autoreset_mode: AutoresetMode,
        batch_size: int,
        seed: int | None,
        on_error: OnError = OnError.RAISE,
        step_timeout: float | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        copy: bool = True,
        check_actions: bool = False,
        worker_memory_limit: int | None = None,
    ) -> None:
        self.num_envs = sum(len(ids) for ids in assignment)
        self.batch_size, self.copy, self.check_actions = batch_size, copy, check_actions
        self.autoreset_mode, self.render_mode = autoreset_mode, render_mode
        self.metadata = {**metadata, "autoreset_mode": autoreset_mode}
        self.single_observation_space, self.single_action_space = observation_space, action_space
        self.observation_space = batch_space(observation_space, self.num_envs)
        self.action_space = batch_space(action_space, self.num_envs)
        if seed is not None:
            self.action_space.seed(seed)
            self.single_action_space.seed(seed)
        self._transport, self._backend = transport, backend
        self._batch = transport.batch
        recovery = dict(on_error=on_error, step_timeout=step_timeout, max_restarts=max_restarts)
        recovery["worker_memory_limit"] = worker_memory_limit
        parts = Parts.wire(self, transport, assignment, env_name, seed, recovery)
        self._ledger, self._recovery, self._dispatch = parts.ledger, parts.recovery, parts.dispatch
        self._life, self._exchange, self._gymnasium = parts.life, parts.exchange, parts.gymnasium
        self._rollouts, self._report = parts.rollouts, parts.report

    @property
    def closed(self) -> bool:  # Gymnasium's attribute, kept by the lifecycle
        return self._life.closed

    @closed.setter
    def closed(self, closed: bool) -> None:
        self._life.closed = closed

    @property
    def on_error(self) -> OnError:
        """The failure policy (``make(on_error=...)``)."""
        return self._recovery.on_error

    @property
    def step_timeout(self) -> float | None:
        """Seconds a worker may owe a reply before it is killed (``None``: no limit)."""
        return self._recovery.step_timeout

    @property
    def max_restarts(self) -> int:
        """Restarts allowed per env."""
        return self._recovery.max_restarts

    @property
    def worker_memory_limit(self) -> int | None:
        """Bytes of memory a worker may use before it is replaced (``None``: no limit)."""
        return self._recovery.worker_memory_limit

    @worker_memory_limit.setter
    def worker_memory_limit(self, limit: int | None) -> None:
        limit = check_memory_limit(limit)
        if limit is not None and not self._backend.capabilities.worker_memory_limit:
            raise ValueError(refusal("worker_memory_limit", self._backend))
        self._recovery.worker_memory_limit = limit

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (or those in ``options["reset_mask"]``) and wait for them.

        Args:
            seed: ``None``, an int ``s`` (env ``i`` gets ``s + i``) or one seed per env. A pool
                made with ``seed=s`` uses ``s + i`` on its first reset.
            options: passed to each env's ``reset``; ``"reset_mask"`` (a bool array of shape
                ``(num_envs,)``) resets only those envs, as Gymnasium's DISABLED mode needs.

        Returns:
            The observations of all envs and the infos of the envs reset.
        """
        return self._exchange.reset(seed, options, self.copy)

    def step(
        self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step envs with ``actions`` and return the next batch.

        Gymnasium's ``step`` in sync mode (``batch_size == num_envs``, ``env_id=None``);
        otherwise :meth:`send` followed by :meth:`recv`."""
        return self._exchange.step(actions, env_id, self.batch_size, self.copy, self.check_actions)

    def render(self) -> tuple[Any, ...] | None:
        """The frames of every env (``env.render()`` of each)."""
        return self.call("render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env (or read attribute ``name``); one result per env."""
        return self._exchange.call(name, args, kwargs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env (through wrappers)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set attribute ``name`` of every env: one value each, or one value for all."""
        self._exchange.set_attr(name, values)

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT, **kwargs: Any) -> None:
        """Stop every worker and free every resource. Idempotent; safe after any error.

        Args:
            timeout: seconds to let envs close cleanly before their workers are terminated;
                ``None`` (Gymnasium's "no limit") is the default bound: a close never waits
                without one (``inf``, ``nan`` refused). Gymnasium's ``terminate`` is ignored.
        """
        self._life.close(timeout)

    def close_extras(self, **kwargs: Any) -> None:
        self.close(**kwargs)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self._life.dropped()

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """Each env's ``np_random_seed``, as Gymnasium's: ``(s, s + 1, ...)`` after seed s."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """The random number generator of each env (copies, from a worker process)."""
        return self.get_attr("np_random")

    @property
    def num_workers(self) -> int:
        """Workers the envs are split over."""
        return len(self._ledger.assignment)

    def stats(self) -> PoolStats:
        """Per-worker step latency (p50/p99), idle fraction, steps, episodes and restarts.

        Returns:
            PoolStats: the figures since the pool was made; ``print()`` it for a readable
                summary (a line per worker, and per node on a cluster), read its fields, or
                ``as_dict()`` for JSON.

        Examples:
            >>> import envfleet
            >>> with envfleet.make("CartPole-v1", 2, backend="serial", seed=0) as pool:
            ...     _ = pool.reset()
            ...     _ = pool.step([0, 0])
            ...     stats = pool.stats()
            >>> stats.steps, len(stats.workers), stats.workers[0].env_ids
            (2, 1, (0, 1))
            >>> print(stats)  # doctest: +ELLIPSIS
            2 steps in ... s (...), 0 episodes, 0 restarts
              worker 0 (envs 0-1): latency p50 ... ms, p99 ... ms, idle ...%, 2 steps, ...
        """
        return self._report.stats()

    def describe(self) -> dict[str, Any]:
        """Where the pool stands, as plain values (per worker the commands unanswered, the envs
        in flight and ready, each env's restarts); safe from another thread while a step waits."""
        return self._report.describe()

    @property
    def restarts(self) -> np.ndarray:
        """How many times each env has been restarted (``on_error="restart"``)."""
        return self._report.restarts()

    def async_reset(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
        env_id: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Start resetting envs ``env_id`` (default all); their results come from :meth:`recv`.

        Args:
            seed: ``None``, an int ``s`` (env ``i`` gets ``s + i``) or one seed per env reset.
            options: passed to each env's ``reset``.
            env_id: the envs to reset; each must be idle.
        """
        self._exchange.async_reset(seed, options, env_id)

    def send(self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None) -> None:
        """Send one action to each env of ``env_id`` (default all); non-blocking.

        Raises:
            ValueError, TypeError: actions or env ids do not match what the pool expects.
            AlreadyPendingError: an env in ``env_id`` still has a step or result pending.
        """
        self._exchange.send(actions, env_id, self.check_actions)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for ``batch_size`` envs and return their results; ``infos["env_id"]`` names them.

        Raises:
            NoPendingError: fewer than ``batch_size`` envs are in flight or ready.
        """
        return self._exchange.recv(self.batch_size, self.copy)

    def step_async(self, actions: Any) -> None:
        """``AsyncVectorEnv.step_async``: start stepping every env; :meth:`step_wait` returns the
        results (:meth:`send`/:meth:`recv` also return the first ``batch_size`` envs ready).

        Raises:
            AlreadyPendingError: an async call is pending (``AlreadyPendingCallError``).
        """
        self._gymnasium.step_async(actions)

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """``AsyncVectorEnv.step_wait``: the results of :meth:`step_async`, as :meth:`step`
        returns them (``timeout``, for Gymnasium's signature: ``step_timeout`` bounds waits).

        Raises:
            NoPendingError: no ``step_async`` is pending (``NoAsyncCallError``).
        """
        return self._gymnasium.step_wait()

    def reset_async(
        self, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """``AsyncVectorEnv.reset_async``: :meth:`reset_wait` resets the envs as :meth:`reset`
        does and returns what it returns (arguments checked here; the reset starts there).

        Raises:
            AlreadyPendingError: an async call is pending (``AlreadyPendingCallError``).
        """
        self._gymnasium.reset_async(seed, options)

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """``AsyncVectorEnv.reset_wait``: the reset that :meth:`reset_async` asked for.

        Raises:
            NoPendingError: no ``reset_async`` is pending (``NoAsyncCallError``).
        """
        return self._gymnasium.reset_wait()

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """``AsyncVectorEnv.call_async``: :meth:`call_wait` calls method ``name`` of every env
        (or reads attribute ``name``) as :meth:`call` does and returns what it returns.

        Raises:
            AlreadyPendingError: an async call is pending (``AlreadyPendingCallError``).
        """
        self._gymnasium.call_async(name, args, kwargs)

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """``AsyncVectorEnv.call_wait``: the results of the :meth:`call_async` pending, one per
        env (``timeout``, for Gymnasium's signature: ``step_timeout`` bounds waits).

        Raises:
            NoPendingError: no ``call_async`` is pending (``NoAsyncCallError``).
        """
        return self._gymnasium.call_wait()

    def rollout(self, policy: Policy, steps: int) -> Rollout:
        """Step every env ``steps`` times with ``policy``'s actions, the policy running on the
        workers: one message per worker (per node, on a cluster). The same as ``steps`` calls
        of ``pool.step(policy(obs, np.arange(num_envs)))``: autoreset, restarts, infos, flags;
        :meth:`rollout_async` of every env, then :meth:`rollout_wait` of all.

        Args:
            policy: ``policy(observations, env_ids) -> actions`` (:class:`Policy`), picklable
                by cloudpickle; with ``weights()``/``load_weights`` its code travels once.
            steps: vector steps, at least 1.

        Returns:
            Rollout: every step's arrays, shaped ``(steps, num_envs, ...)``.

        Raises:
            ValueError, TypeError: unusable ``steps``, ``policy`` or spaces (nothing sent).
            AlreadyPendingError, ResetNeededError: an env is pending, or was never reset.
            EnvError: an env failed, as ``step`` raises it; or the policy did (its envs stand
                where it stopped, the pool usable).

        Examples:
            See :class:`Rollout`.
        """
        return self._rollouts.rollout(policy, steps, self.check_actions)

    def rollout_async(
        self,
        policy: Policy,
        steps: int,
        env_ids: Sequence[int] | np.ndarray | None = None,
        version: int | None = None,
        queue: bool = False,
    ) -> int:
        """Start a rollout of ``env_ids`` (whole workers' envs; default all); return the
        version that acts. The policy's code goes once, each version's weights once a worker.

        Args:
            policy: as for :meth:`rollout`.
            steps: vector steps, at least 1.
            env_ids: the envs to roll out (``r.env_ids`` of a :class:`Rollout` handed over).
            version: stamped on every action; ``None``: counted (one more on new weights).
            queue: behind each worker's part out, if any (one at most), with no round trip.

        Raises:
            AlreadyPendingError: an env of ``env_ids`` has a step, result or rollout pending.
        """
        return self._rollouts.start(policy, steps, env_ids, version, self.check_actions, queue)

    def rollout_wait(
        self, min_envs: int | None = None, timeout: float | None = None, max_lag: int | None = None
    ) -> Rollout:
        """The parts of pending rollouts done: all (``min_envs=None``), or once ``min_envs``
        envs' are (the rest come later), or those done within ``timeout`` s. Parts acting
        more than ``max_lag`` versions behind the newest are dropped; ``stats()`` counts lags.

        Raises:
            NoPendingError: no rollout is pending.
            TimeoutError: no part was done within ``timeout`` (they still come later).
        """
        return self._rollouts.wait(min_envs, timeout, max_lag)

    def _gather(self, env_ids: np.ndarray) -> tuple[Any, ...]:
        """Results of ready ``env_ids`` as ``recv`` returns them (gathered onto an error)."""
        return self._exchange.results(env_ids, self.copy)

    def __repr__(self) -> str:
        return self._report.summary(self.batch_size, self.closed)


__all__ = ["DEFAULT_CLOSE_TIMEOUT", "DEFAULT_MAX_RESTARTS", "EnvState", "Pool"]
