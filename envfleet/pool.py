"""Pool: the ``gymnasium.vector.VectorEnv`` users hold, over any backend.

Sync ``step`` is ``send`` of every env followed by ``recv`` of every env; async mode
(``batch_size < num_envs``) returns the first ``batch_size`` envs whose results are in, EnvPool
style. The pool validates every action before anything reaches a worker, tracks which envs are
in flight with one explicit state per env, and turns failures into :class:`~envfleet.EnvError`.

Granularity: per env. Actions go to workers per worker (one message steps all of that worker's
envs in the call), but results are handed out per env, so ``batch_size`` need not be a multiple
of the envs per worker: envs that are done but not yet returned wait in a FIFO for the next
``recv``.

The pool is four objects, each in its own module; this one is the face:

- the **face** (:class:`Pool`): the Gymnasium and async API; checks every argument at the
  edge, writes the actions, tells the dispatch what to send, and returns results read from
  the batch arrays with infos merged Gymnasium's way;
- the **dispatch** (:mod:`envfleet.dispatch`): builds the typed commands per worker, sends
  them (the ledger told, the transport handing them over) and takes the replies in, within
  recovery's bounds;
- the **ledger** (:mod:`envfleet.ledger`): per-env states, commands pending per worker, the
  ready FIFO; the face asks it before sending and tells it what it sent;
- **recovery** (:mod:`envfleet.recovery`): books each reply in the ledger, and handles failed
  envs, lost and hung workers, restarts and their limits, and the failure policy.

Data flow: ``send`` → face (validate, write actions) → dispatch → ledger (``sent``) →
transport (to the workers) → ``wait`` (rows already in the batch: the transport delivers them)
→ recovery (``take`` → ledger ``took``: envs ready) → ``recv`` (face reads the batch, ledger
hands out).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from envfleet.actions import ActionWriter
from envfleet.backends import Transport
from envfleet.backends.registry import TransportKind, refusal
from envfleet.dispatch import Dispatch
from envfleet.errors import (
    AlreadyPendingError,
    BrokenPoolError,
    ClosedPoolError,
    NoPendingError,
    OnError,
    ResetNeededError,
)
from envfleet.gymnasium_async import GymnasiumAsync
from envfleet.ledger import EnvState, Ledger
from envfleet.protocol import Call, SetAttr
from envfleet.recovery import DEFAULT_MAX_RESTARTS, Recovery
from envfleet.results import ResultReader, Results
from envfleet.rollouts import PoolRollouts
from envfleet.stats import PoolStats, StatsRecorder, node_layout
from envfleet.validation import (
    ActionCheck,
    check_attr_values,
    check_close_timeout,
    check_env_ids,
    check_memory_limit,
    check_options,
    check_reset_mask,
    check_seeds,
)

DEFAULT_CLOSE_TIMEOUT = 5.0


class Pool(GymnasiumAsync, PoolRollouts, VectorEnv):  # type: ignore[misc]
    """Many copies of an environment stepped in parallel; build one with :func:`envfleet.make`.

    Attributes:
        num_envs: number of envs.
        batch_size: envs returned by each :meth:`recv` (``num_envs`` in sync mode).
        autoreset_mode: Gymnasium's autoreset mode the envs follow.
        copy: whether observations are returned as copies (the default) or, when the envs
            returned are a run of consecutive envs in order (every env in sync ``step`` and
            ``reset``; one worker's block in an async batch), as views of the batch arrays,
            which the next step of those envs overwrites (Gymnasium's ``copy``).
        check_actions: whether each action is checked against the action space before it is
            sent (``make(check_actions=True)``); by default only the batch's shape is.

    Examples:
        Gymnasium's loop, and the first envs ready with ``send``/``recv``:

        >>> import envfleet
        >>> with envfleet.make("CartPole-v1", num_envs=4, num_workers=2, seed=0) as pool:
        ...     obs, infos = pool.reset()
        ...     obs, rewards, terminations, truncations, infos = pool.step([0, 1, 0, 1])
        >>> obs.shape, pool.num_workers
        ((4, 4), 2)
        >>> with envfleet.make("CartPole-v1", num_envs=4, batch_size=2, seed=0) as pool:
        ...     pool.async_reset()
        ...     obs, rewards, terminations, truncations, infos = pool.recv()  # 2 envs ready
        ...     pool.send([0, 1], infos["env_id"])
        >>> obs.shape, len(infos["env_id"])
        ((2, 4), 2)
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
        self.batch_size = batch_size
        self.copy = copy
        self.autoreset_mode = autoreset_mode
        self.metadata = {**metadata, "autoreset_mode": autoreset_mode}
        self.render_mode = render_mode
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = batch_space(observation_space, self.num_envs)
        self.action_space = batch_space(action_space, self.num_envs)
        if seed is not None:
            self.action_space.seed(seed)
            self.single_action_space.seed(seed)
        self.closed = False
        self._owner_pid = os.getpid()
        _LIVE.add(self)
        self.check_actions = check_actions
        self._env_name = env_name
        self._transport = transport
        self._backend = backend
        self._batch = transport.batch
        self._stats = StatsRecorder([tuple(ids) for ids in assignment], self.num_envs)
        self._ledger = ledger = Ledger(assignment, self._stats)
        self._recovery = Recovery(
            ledger,
            env_name=env_name,
            on_error=on_error,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            worker_memory_limit=worker_memory_limit,
        )
        self._dispatch = Dispatch(transport, ledger, self._recovery, env_name, self._gather)
        self._assignment = ledger.assignment
        self._worker_of = ledger.worker_of
        self._all_ids = ledger.all_ids
        self._check_actions = ActionCheck(action_space, self.num_envs)
        self._actions = ActionWriter(
            action_space, self._batch.actions, self._all_ids, self._worker_of, len(assignment)
        )
        self._needs_reset = np.zeros(self.num_envs, dtype=np.bool_)
        self._read = ResultReader(
            self._batch, observation_space, ledger, self._stats, self._needs_reset
        )
        # Envs never reset yet: a step of one is refused before anything is sent (#19).
        self._never_reset = np.ones(self.num_envs, dtype=np.bool_)
        self._all_reset = False
        self._first_seed = seed

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

    # -- the Gymnasium API ---------------------------------------------------------------------

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
        self._check_usable()
        options = check_options(options)
        env_ids = np.arange(self.num_envs)
        if options is not None and "reset_mask" in options:
            env_ids = np.flatnonzero(check_reset_mask(options.pop("reset_mask"), self.num_envs))
        busy = self._ledger.busy(self._all_ids)
        if busy.size:
            raise AlreadyPendingError(
                f"reset() needs every env idle, but envs {busy.tolist()} have results pending; "
                "recv() them first (or use async_reset(env_id=...))"
            )
        seeds = self._seeds_for(seed, env_ids, per_env=self.num_envs)
        self._submit_reset(env_ids, seeds, options)
        self._dispatch.collect(env_ids)
        self._needs_reset[env_ids] = False
        infos = self._read.infos(env_ids, positions=env_ids, size=self.num_envs)
        return self._read.observations(None, self.copy), infos

    def step(
        self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step envs with ``actions`` and return the next batch.

        In sync mode (``batch_size == num_envs``, ``env_id=None``) this is Gymnasium's
        ``step``; otherwise it is :meth:`send` followed by :meth:`recv`.
        """
        if env_id is None and self.batch_size == self.num_envs:
            spares = self._dispatch.spares if self.copy else None
            try:  # with spares, the workers copy the observations into one, handed out as is
                self._send(actions, None, spare=spares is not None)
                self._dispatch.collect(self._all_ids)
                return self._read.results(self._all_ids, copy=spares or self.copy)
            finally:
                if spares is not None:
                    spares.disarm()
        if env_id is not None:
            self._check_usable()
            # Refused before sending: a send that recv() cannot complete left its envs pending.
            sent = len(check_env_ids(env_id, self.num_envs))
            owed = self._ledger.owed()
            if owed + sent < self.batch_size:
                raise NoPendingError(
                    f"step(env_id=...) of {sent} envs returns batch_size={self.batch_size} envs, "
                    f"but only {owed + sent} would be pending; send more envs (or use send())"
                )
        self.send(actions, env_id)
        return self.recv()

    def render(self) -> tuple[Any, ...] | None:
        """The frames of every env (``env.render()`` of each)."""
        return self.call("render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env (or read attribute ``name``); one result per env."""
        commands = [Call(name, args, kwargs) for _ in self._assignment]
        self._check_usable()
        return self._dispatch.call(commands)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env (through wrappers)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set attribute ``name`` of every env: one value each, or one value for all."""
        values = check_attr_values(name, values, self.num_envs)
        commands = [SetAttr(name, {i: values[i] for i in ids}) for ids in self._assignment]
        self._check_usable()
        self._dispatch.call(commands)

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT, **kwargs: Any) -> None:
        """Stop every worker and free every resource. Idempotent; safe after any error.

        Args:
            timeout: seconds to let envs close cleanly before their workers are terminated.
                ``None`` (Gymnasium's ``close(timeout=None)``, no limit) is the default
                bound: a close never waits without one (``inf`` and ``nan`` are refused).
                Other keywords of Gymnasium's ``close`` (``terminate``) are accepted and
                ignored.
        """
        if self.closed:
            return
        timeout = check_close_timeout(timeout, DEFAULT_CLOSE_TIMEOUT)
        self.closed = True
        self._dispatch.close(timeout)

    def close_extras(self, **kwargs: Any) -> None:
        self.close(**kwargs)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            try:
                self.close(timeout=1.0)
            except Exception:
                pass

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
        return len(self._assignment)

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
        stats = self._stats.snapshot(self._recovery.restarts, self._recovery.recycled)
        nodes = self._dispatch.nodes()
        return dataclasses.replace(stats, nodes=nodes) if nodes else stats

    def describe(self) -> dict[str, Any]:
        """Where the pool stands, as plain values: per worker the commands sent and not
        answered, the envs in flight and ready, and each env's restarts. Read-only, and safe to
        call from another thread while a step waits (what a watchdog reports on a stall)."""
        return {**self._ledger.snapshot(), "restarts": self._recovery.restarts.tolist()}

    @property
    def restarts(self) -> np.ndarray:
        """How many times each env has been restarted (``on_error="restart"``)."""
        restarts: np.ndarray = self._recovery.restarts.copy()
        return restarts

    # -- async API (EnvPool style) -------------------------------------------------------------

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
        self._check_usable()
        options = check_options(options)
        env_ids = self._idle_ids(env_id, "async_reset")
        seeds = self._seeds_for(seed, env_ids, per_env=len(env_ids))
        self._submit_reset(env_ids, seeds, options)

    def send(self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None) -> None:
        """Send one action to each env of ``env_id`` (default all); non-blocking.

        Raises:
            ValueError, TypeError: actions or env ids do not match what the pool expects.
            AlreadyPendingError: an env in ``env_id`` still has a step or result pending.
        """
        self._send(actions, env_id)

    def _send(self, actions: Any, env_id: Any, spare: bool = False) -> None:
        self._check_usable()
        env_ids = self._idle_ids(env_id, "send")
        if not self._all_reset and self._never_reset[env_ids].any():
            never = env_ids[self._never_reset[env_ids]].tolist()
            raise ResetNeededError(
                f"envs {never} have not been reset yet: call reset() (or async_reset()) before "
                "step()/send(); nothing was sent"
            )
        if self.autoreset_mode is AutoresetMode.DISABLED and self._needs_reset[env_ids].any():
            done = env_ids[self._needs_reset[env_ids]].tolist()
            raise ValueError(
                f"envs {done} ended their episode and autoreset_mode is DISABLED: reset them "
                "first (reset(options={'reset_mask': mask}) or async_reset(env_id=...))"
            )
        actions = self._check_actions(actions, env_ids, self.check_actions)
        if self._recovery.worker_memory_limit is not None:
            self._dispatch.recycle_over_limit()
        self._dispatch.submit_step(env_ids, self._actions.write(actions, env_ids), spare)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for ``batch_size`` envs and return their results; ``infos["env_id"]`` names them.

        Raises:
            NoPendingError: fewer than ``batch_size`` envs are in flight or ready.
        """
        self._check_usable()
        ledger = self._ledger
        owed = ledger.owed()
        if owed < self.batch_size:
            raise NoPendingError(
                f"recv() returns batch_size={self.batch_size} envs but only {owed} have a step "
                "or reset pending; send() actions (or async_reset()) first"
            )
        env_ids = self._dispatch.first_ready(self.batch_size)
        if self.batch_size == self.num_envs:
            env_ids.sort()
        return self._results(env_ids, with_env_id=True)

    # -- internals -----------------------------------------------------------------------------

    def _results(self, env_ids: np.ndarray, *, with_env_id: bool) -> Results:
        return self._read.results(env_ids, with_env_id=with_env_id, copy=self.copy)

    def _gather(self, env_ids: np.ndarray) -> tuple[Any, ...]:
        """Results of ready ``env_ids`` as ``recv`` returns them (gathered onto an error)."""
        return self._results(env_ids, with_env_id=True)

    def _submit_reset(
        self, env_ids: np.ndarray, seeds: list[int | None], options: dict[str, Any] | None
    ) -> None:
        self._dispatch.submit_reset(env_ids, seeds, options)
        self._first_seed = None
        if not self._all_reset:
            self._never_reset[env_ids] = False
            self._all_reset = not self._never_reset.any()

    def _check_usable(self) -> None:
        if self.closed:
            if self._owner_pid != os.getpid():
                raise ClosedPoolError(
                    f"this pool of {self._env_name} belongs to the process that made it (pid "
                    f"{self._owner_pid}); a forked child cannot use it: make one in the child"
                )
            raise ClosedPoolError(f"this pool of {self._env_name} is closed")
        broken = self._recovery.broken
        if broken is not None:
            raise BrokenPoolError(
                f"this pool of {self._env_name} is broken by an earlier failure "
                f"({broken}); close() it and make a new one"
            ) from broken

    def _idle_ids(self, env_id: Sequence[int] | np.ndarray | None, what: str) -> np.ndarray:
        if env_id is None and self._ledger.all_idle():  # every env idle: the sync step
            return self._all_ids
        env_ids = check_env_ids(env_id, self.num_envs)
        busy = self._ledger.busy(env_ids)
        if busy.size:
            raise AlreadyPendingError(
                f"{what}: envs {busy.tolist()} already have a step or result pending; "
                "recv() their results first"
            )
        return env_ids

    def _seeds_for(
        self, seed: int | Sequence[int | None] | None, env_ids: np.ndarray, per_env: int
    ) -> list[int | None]:
        if seed is None:  # the pool's seed, until a reset has been sent (_submit_reset)
            seed = self._first_seed
        return check_seeds(seed, env_ids, per_env, self.num_envs)

    def __repr__(self) -> str:
        nodes = "" if self.closed else node_layout(self._dispatch.nodes())
        return (
            f"Pool({self._env_name}, num_envs={self.num_envs}, workers={len(self._assignment)}, "
            f"batch_size={self.batch_size}{nodes})"
        )


_LIVE: weakref.WeakSet[Pool] = weakref.WeakSet()
"""Every open pool of this process, for :func:`_forked`."""


def _forked() -> None:
    """In a forked child, the pools inherited are their parent's (its workers, its memory):
    closed here without touching them, so that the child's ``close()``, garbage collection or
    exit cannot stop the parent's workers (they were sent Close, and SIGTERM)."""
    for pool in list(_LIVE):
        pool.closed = True
        pool._dispatch.forked()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


__all__ = ["DEFAULT_MAX_RESTARTS", "EnvState", "Pool"]
