"""Pool: the ``gymnasium.vector.VectorEnv`` users hold, over any backend.

Sync ``step`` is ``send`` of every env followed by ``recv`` of every env; async mode
(``batch_size < num_envs``) returns the first ``batch_size`` envs whose results are in, EnvPool
style. The pool validates every action before anything reaches a worker, tracks which envs are
in flight with one explicit state per env, and turns failures into :class:`~envfleet.EnvError`.

Granularity: per env. Actions go to workers per worker (one message steps all of that worker's
envs in the call), but results are handed out per env, so ``batch_size`` need not be a multiple
of the envs per worker: envs that are done but not yet returned wait in a FIFO for the next
``recv``.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, iterate

from envfleet.backends import Transport, WorkerLost
from envfleet.buffers import is_array_space, put, take
from envfleet.errors import (
    AlreadyPendingError,
    BrokenPoolError,
    ClosedPoolError,
    EnvError,
    EnvTimeoutError,
    NoPendingError,
    OnError,
    Phase,
    RestartLimitError,
    WorkerDiedError,
)
from envfleet.infos import merge_infos
from envfleet.protocol import Call, Close, Command, EnvFailure, Reply, Reset, Rows, SetAttr, Step
from envfleet.stats import PoolStats, StatsRecorder
from envfleet.validation import check_actions, check_env_ids, keeps_dtype

DEFAULT_CLOSE_TIMEOUT = 5.0
DEFAULT_MAX_RESTARTS = 100
MEMORY_CHECK_INTERVAL = 1.0
"""Seconds between checks of the workers' memory against ``worker_memory_limit``."""
DRAIN_TIMEOUT = 5.0
"""Seconds a failing call waits for the other envs' results, gathered on the error."""


class EnvState(enum.IntEnum):
    """Where each env of the pool stands."""

    IDLE = 0  # its last result was handed to the caller; it may be sent an action
    IN_FLIGHT = 1  # a step or reset was sent; its result is not in yet
    READY = 2  # its result is in and waits for ``recv``


# Plain ints for the hot path (an Enum member lookup costs more than the comparison).
_IDLE, _IN_FLIGHT, _READY = int(EnvState.IDLE), int(EnvState.IN_FLIGHT), int(EnvState.READY)


class Pool(VectorEnv):  # type: ignore[misc]
    """Many copies of an environment stepped in parallel; build one with :func:`envfleet.make`.

    Attributes:
        num_envs: number of envs.
        batch_size: envs returned by each :meth:`recv` (``num_envs`` in sync mode).
        autoreset_mode: Gymnasium's autoreset mode the envs follow.
        copy: whether observations are returned as copies (the default) or, when every env
            is returned in order (sync ``step`` and ``reset``), as the batch arrays themselves,
            which the next step overwrites (Gymnasium's ``copy`` of its vector envs).
        check_actions: whether each action is checked against the action space before it is
            sent (``make(check_actions=True)``); by default only the batch's shape is.
    """

    def __init__(
        self,
        transport: Transport,
        assignment: Sequence[tuple[int, ...]],
        *,
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
        self.check_actions = check_actions
        self._env_name = env_name
        self._transport = transport
        self._batch = transport.batch
        self._assignment = [tuple(ids) for ids in assignment]
        self._worker_of = np.empty(self.num_envs, dtype=np.intp)
        for worker, ids in enumerate(self._assignment):
            self._worker_of[list(ids)] = worker
        self._array_actions = is_array_space(action_space)
        self._shares_memory = transport.shares_memory
        self._state = np.zeros(self.num_envs, dtype=np.int8)
        self._ready: deque[int] = deque()
        self._infos: dict[int, dict[str, Any]] = {}
        self._pending: list[deque[Command]] = [deque() for _ in self._assignment]
        self._answers: dict[int, Reply] = {}
        self._needs_reset = np.zeros(self.num_envs, dtype=np.bool_)
        self._first_seed = seed
        self._broken: BaseException | None = None
        self.on_error = on_error
        self.step_timeout = step_timeout
        self.max_restarts = max_restarts
        self._restarts = np.zeros(self.num_envs, dtype=np.int64)
        self._busy_since = [0.0] * len(self._assignment)
        self._hung: dict[int, float] = {}
        self._draining = False
        self._stats = StatsRecorder(self._assignment, self.num_envs)
        self._in_flight = 0  # envs with a step or reset sent and no reply yet
        self._all_ids = np.arange(self.num_envs)
        self._all_ids.flags.writeable = False  # shared by every sync step: never handed out
        self._indices: dict[tuple[int, ...], np.ndarray] = {}
        self._step_all = [Step(ids) for ids in self._assignment]  # reused: pickled once
        # Set while every worker's only pending command is its part of a whole-pool step sent
        # by _submit_all: the replies can then be taken for all workers at once.
        self._all_out: float | None = None
        # A transport may hand a whole-pool step to every worker at once (the thread backend's
        # one wake-up for all threads); the others get one submit per worker.
        self._submit_each_at_once: Callable[[Sequence[Command]], None] | None = getattr(
            transport, "submit_all", None
        )
        self.worker_memory_limit = worker_memory_limit
        self._memory_checked = time.monotonic()
        self._recycled = [0] * len(self._assignment)
        # Serialises a command before anything changes (a transport that pickles has one), so
        # that a command the caller's data cannot travel in fails with the pool as it was.
        self._prepare: Callable[[int, Command], None] | None = getattr(transport, "prepare", None)

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
        options = _check_options(options)
        env_ids = np.arange(self.num_envs)
        if options is not None and "reset_mask" in options:
            env_ids = np.flatnonzero(self._check_reset_mask(options.pop("reset_mask")))
        busy = np.flatnonzero(self._state != _IDLE)
        if busy.size:
            raise AlreadyPendingError(
                f"reset() needs every env idle, but envs {busy.tolist()} have results pending; "
                "recv() them first (or use async_reset(env_id=...))"
            )
        seeds = self._seeds_for(seed, env_ids, per_env=self.num_envs)
        self._submit_reset(env_ids, seeds, options)
        self._collect(env_ids)
        self._needs_reset[env_ids] = False
        infos = self._merge_infos(env_ids, positions=env_ids, size=self.num_envs)
        return self._observations(None), infos

    def step(
        self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step envs with ``actions`` and return the next batch.

        In sync mode (``batch_size == num_envs``, ``env_id=None``) this is Gymnasium's
        ``step``; otherwise it is :meth:`send` followed by :meth:`recv`.
        """
        if env_id is None and self.batch_size == self.num_envs:
            self.send(actions)
            self._collect(self._all_ids)
            return self._results(self._all_ids, with_env_id=False)
        self.send(actions, env_id)
        return self.recv()

    def render(self) -> tuple[Any, ...] | None:
        """The frames of every env (``env.render()`` of each)."""
        return self.call("render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env (or read attribute ``name``); one result per env."""
        return self._call_all(lambda ids: Call(name, args, kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env (through wrappers)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set attribute ``name`` of every env: one value each, or one value for all."""
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"set_attr({name!r}) needs one value per env ({self.num_envs}), got {len(values)}"
            )
        self._call_all(lambda ids: SetAttr(name, {i: values[i] for i in ids}))

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT, **kwargs: Any) -> None:
        """Stop every worker and free every resource. Idempotent; safe after any error.

        Args:
            timeout: seconds to let envs close cleanly before their workers are terminated.
        """
        if self.closed:
            return
        self.closed = True
        self._transport.close(timeout)

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
        """The ``np_random_seed`` of each env, as Gymnasium's vector envs give it: after
        ``reset(seed=s)``, ``(s, s + 1, ...)``."""
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

        Example:
            >>> import envfleet
            >>> with envfleet.make("CartPole-v1", 2, backend="serial", seed=0) as pool:
            ...     _ = pool.reset()
            ...     _ = pool.step([0, 0])
            ...     stats = pool.stats()
            >>> stats.steps, len(stats.workers)
            (2, 1)
        """
        return self._stats.snapshot(self._restarts, self._recycled)

    @property
    def restarts(self) -> np.ndarray:
        """How many times each env has been restarted (``on_error="restart"``)."""
        restarts: np.ndarray = self._restarts.copy()
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
        options = _check_options(options)
        env_ids = self._idle_ids(env_id, "async_reset")
        seeds = self._seeds_for(seed, env_ids, per_env=len(env_ids))
        self._submit_reset(env_ids, seeds, options)

    def send(self, actions: Any, env_id: Sequence[int] | np.ndarray | None = None) -> None:
        """Send one action to each env of ``env_id`` (default all); non-blocking.

        Raises:
            ValueError, TypeError: actions or env ids do not match what the pool expects.
            AlreadyPendingError: an env in ``env_id`` still has a step or result pending.
        """
        self._check_usable()
        if self.worker_memory_limit is not None:
            self._recycle_over_limit()
        env_ids = self._idle_ids(env_id, "send")
        if self.autoreset_mode is AutoresetMode.DISABLED and self._needs_reset[env_ids].any():
            done = env_ids[self._needs_reset[env_ids]].tolist()
            raise ValueError(
                f"envs {done} ended their episode and autoreset_mode is DISABLED: reset them "
                "first (reset(options={'reset_mask': mask}) or async_reset(env_id=...))"
            )
        space = self.single_action_space
        actions = check_actions(space, actions, env_ids, check_membership=self.check_actions)
        carried: list[dict[int, Any]] | None = None
        # Actions of another dtype than the space's would be cast by the batch arrays: they
        # travel with the command, so the env gets exactly what the caller gave (fidelity).
        if self._array_actions and self._shares_memory and keeps_dtype(space, actions):
            rows = None if env_ids is self._all_ids else env_ids
            put(space, self._batch.actions, rows, actions)
        else:
            # The actions travel with the command (pickled path, or no shared memory).
            if isinstance(actions, np.ndarray):
                items = list(actions)
            else:
                items = list(iterate(batch_space(space, len(env_ids)), actions))
            carried = [dict[int, Any]() for _ in self._assignment]
            for i, item in zip(env_ids.tolist(), items, strict=True):
                carried[self._worker_of[i]][i] = item
        if carried is None and len(env_ids) == self.num_envs:
            self._submit_all()
            return
        self._submit_many(
            [
                (worker, Step(ids, carried[worker] if carried is not None else None))
                for worker, ids in self._by_worker(env_ids)
            ]
        )

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for ``batch_size`` envs and return their results; ``infos["env_id"]`` names them.

        Raises:
            NoPendingError: fewer than ``batch_size`` envs are in flight or ready.
        """
        self._check_usable()
        owed = int(np.count_nonzero(self._state != _IDLE))
        if owed < self.batch_size:
            raise NoPendingError(
                f"recv() returns batch_size={self.batch_size} envs but only {owed} have a step "
                "or reset pending; send() actions (or async_reset()) first"
            )
        while len(self._ready) < self.batch_size:
            self._pump(block=True)
        env_ids = np.array([self._ready.popleft() for _ in range(self.batch_size)])
        self._state[env_ids] = _IDLE
        if self.batch_size == self.num_envs:
            env_ids.sort()
        return self._results(env_ids, with_env_id=True)

    # -- internals -----------------------------------------------------------------------------

    def _results(
        self, env_ids: np.ndarray, *, with_env_id: bool
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        batch = self._batch
        whole = env_ids is self._all_ids or (
            len(env_ids) == self.num_envs and bool((env_ids[1:] > env_ids[:-1]).all())
        )
        if whole:  # every env in order: plain copies, no fancy indexing
            rows = None
            terminations = batch.terminations.copy()
            truncations = batch.truncations.copy()
            rewards = batch.rewards.copy()
            done = terminations | truncations
            self._needs_reset[:] = done
        else:
            rows = env_ids
            terminations = batch.terminations[env_ids]
            truncations = batch.truncations[env_ids]
            rewards = batch.rewards[env_ids]
            done = terminations | truncations
            self._needs_reset[env_ids] = done
        self._stats.ended(env_ids, done)
        infos = self._merge_infos(env_ids, positions=range(len(env_ids)), size=len(env_ids))
        if with_env_id:
            infos["env_id"] = env_ids
        return (
            self._observations(rows),
            rewards,
            terminations,
            truncations,
            infos,
        )

    def _observations(self, rows: np.ndarray | None) -> Any:
        """The observations of ``rows`` (every env, in order, when ``None``)."""
        observations = self._batch.observations
        if rows is None and not self.copy and not isinstance(observations, list):
            return observations
        return take(self.single_observation_space, observations, rows)

    def _merge_infos(
        self, env_ids: Iterable[int], positions: Iterable[int], size: int
    ) -> dict[str, Any]:
        if not self._infos:  # the common case: no env had anything to say
            return {}
        pairs = [
            (self._infos.pop(int(i), None), int(p))
            for i, p in zip(env_ids, positions, strict=False)
        ]
        return merge_infos(pairs, size)

    def _recycle_over_limit(self) -> None:
        """Replace each idle worker whose memory is over ``worker_memory_limit`` (a leaking env
        would otherwise grow until the machine runs out); its envs restart as after a failure
        (their episodes reported truncated, ``infos["envfleet/restarted"]``)."""
        now = time.monotonic()
        if now - self._memory_checked < MEMORY_CHECK_INTERVAL:
            return
        self._memory_checked = now
        limit = self.worker_memory_limit
        memory = getattr(self._transport, "memory", None)
        if limit is None or memory is None:
            return
        for worker, ids in enumerate(self._assignment):
            if self._pending[worker] or (self._state[list(ids)] != _IDLE).any():
                continue  # between steps only: nothing of it in flight or unread
            used = memory(worker)
            if used is None or used <= limit:
                continue
            self._restarts[list(ids)] += 1
            self._recycled[worker] += 1
            try:
                self._transport.restart(worker, {i: int(self._restarts[i]) for i in ids})
            except EnvError as exc:  # the replacement could not build its envs
                self._fail(exc)

    def _submit_reset(
        self, env_ids: np.ndarray, seeds: list[int | None], options: dict[str, Any] | None
    ) -> None:
        if self.worker_memory_limit is not None:
            self._recycle_over_limit()
        seed_of = dict(zip(env_ids.tolist(), seeds, strict=True))
        self._submit_many(
            [
                (worker, Reset(ids, tuple(seed_of[i] for i in ids), options))
                for worker, ids in self._by_worker(env_ids)
            ]
        )
        self._first_seed = None

    def _collect(self, env_ids: np.ndarray) -> None:
        """Wait until every env of ``env_ids`` is ready and take them out of the FIFO."""
        if len(env_ids) == self.num_envs:
            while self._in_flight:
                want = self.num_workers if self._all_out else sum(map(len, self._pending))
                self._pump(block=True, want=want)
            self._ready.clear()
            self._state.fill(_IDLE)
            return
        while (self._state[env_ids] == _IN_FLIGHT).any():
            self._pump(block=True)
        wanted = set(env_ids.tolist())
        self._ready = deque(i for i in self._ready if i not in wanted)
        self._state[env_ids] = _IDLE

    def _call_all(self, command_for: Any) -> tuple[Any, ...]:
        self._check_usable()
        commands = [command_for(ids) for ids in self._assignment]
        self._submit_many(list(enumerate(commands)))
        while any(id(c) not in self._answers for c in commands):
            self._pump(block=True)
        values: dict[int, Any] = {}
        failures = []
        for worker, command in enumerate(commands):
            reply = self._answers.pop(id(command))
            values.update(reply.values or {})
            failures += [(worker, f) for f in reply.failures]
        if failures:
            worker, failure = failures[0]
            raise failure.to_error(worker, self._env_name)
        return tuple(values.get(i) for i in range(self.num_envs))

    def _index(self, ids: tuple[int, ...]) -> np.ndarray:
        """``ids`` as an index array (cached: the same tuples come back every step)."""
        index = self._indices.get(ids)
        if index is None:
            if len(self._indices) > 4096:
                self._indices.clear()
            index = self._indices[ids] = np.array(ids, dtype=np.intp)
        return index

    def _submit_all(self) -> None:
        """Send every worker its part of a whole-pool step (all envs idle: the sync step).

        The bookkeeping :meth:`_submit` does per worker is done here for all at once, so the
        pool's thread spends next to nothing per worker beyond handing the command over.
        """
        now = time.monotonic()
        self._state.fill(_IN_FLIGHT)
        self._in_flight += self.num_envs
        pending = self._pending
        if any(pending):  # a worker still owes a reply (not after the usual sync step)
            self._all_out = None
            for worker, command in enumerate(self._step_all):
                if not pending[worker]:
                    self._busy_since[worker] = now
                    self._stats.busy(worker, now)
                pending[worker].append(command)
        else:
            self._all_out = now
            self._busy_since = [now] * len(pending)
            self._stats.busy_all(now)
            for queue, command in zip(pending, self._step_all, strict=True):
                queue.append(command)
            if self._submit_each_at_once is not None:
                self._submit_each_at_once(self._step_all)
                return
        submit = self._transport.submit
        for worker, command in enumerate(self._step_all):
            submit(worker, command)

    def _submit_many(self, commands: list[tuple[int, Command]]) -> None:
        """Submit ``(worker, command)`` pairs, each serialised before the first is sent."""
        if self._prepare is not None:
            for worker, command in commands:
                self._prepare(worker, command)
        for worker, command in commands:
            self._submit(worker, command)

    def _submit(self, worker: int, command: Command) -> None:
        self._all_out = None
        if command.delivers_envs:
            ids = command.env_ids  # type: ignore[union-attr]
            self._state[self._index(ids)] = _IN_FLIGHT
            self._in_flight += len(ids)
        if not self._pending[worker]:
            now = time.monotonic()
            self._busy_since[worker] = now
            self._stats.busy(worker, now)
        self._pending[worker].append(command)
        self._transport.submit(worker, command)

    def _pump(self, block: bool, want: int = 1) -> None:
        """Take in the replies that have arrived (waiting for at least one if ``block``).

        ``want`` tells the transport how many replies are worth waking up for: a sync step waits
        for every pending command anyway.
        """
        timeout = self._wait_timeout() if block else 0.0
        first: EnvError | None = None
        replies = self._transport.wait(timeout, want)
        if (
            self._all_out is not None
            and len(replies) == len(self._pending)
            and all(reply is None for _, reply in replies)
        ):
            self._take_all_plain([worker for worker, _ in replies])
            replies = []
        for worker, reply in replies:
            error = self._take(worker, reply)
            first = first or error
        if self.step_timeout is not None:
            self._kill_hung_workers()
        if first is not None:
            self._fail(first)

    def _take_all_plain(self, workers: list[int]) -> None:
        """Every worker answered its part of a whole-pool step with nothing to report.

        Each worker had exactly that one command pending (``_all_out``), and as many replies
        as workers came in, so each worker answered once: :meth:`_take` for all at once.
        ``workers`` is the order the replies came in, which async ``recv`` hands envs out in.
        """
        started, self._all_out = self._all_out, None
        assert started is not None
        now = time.monotonic()
        for queue in self._pending:
            queue.popleft()
        self._busy_since = [now] * len(self._pending)
        self._stats.replied_all(started, now)
        self._state.fill(_READY)
        assignment = self._assignment
        self._ready.extend([i for worker in workers for i in assignment[worker]])
        self._in_flight -= self.num_envs

    def _take(self, worker: int, reply: Reply | WorkerLost | None) -> EnvError | None:
        """Account for one reply; return the error it reports, if any."""
        self._all_out = None
        if isinstance(reply, WorkerLost):
            return self._lost(worker, reply)
        pending = self._pending[worker]
        command = pending.popleft()
        now = time.monotonic()
        steps = len(command.env_ids) if isinstance(command, Step) else 0
        self._stats.replied(worker, self._busy_since[worker], now, steps, not pending)
        self._busy_since[worker] = now
        if reply is None:  # done, nothing to report: the hot path of the process backend
            if command.delivers_envs:
                ids = command.env_ids  # type: ignore[union-attr]
                self._state[self._index(ids)] = _READY
                self._ready.extend(ids)
                self._in_flight -= len(ids)
            else:
                self._answers[id(command)] = Reply()
            return None
        error = self._count_restarts(worker, reply.restarts) if reply.restarts else None
        if not command.delivers_envs:
            self._answers[id(command)] = reply
            return error
        failed = {f.env_index for f in reply.failures}
        if reply.rows is not None:
            self._write_rows(reply.rows)
        if reply.observations:
            for i, obs in reply.observations.items():
                if i not in failed:
                    self._batch.observations[i] = obs
        if reply.infos:
            self._infos.update(reply.infos)
        self._in_flight -= len(command.env_ids)  # type: ignore[union-attr]
        for i in command.env_ids:  # type: ignore[union-attr]
            if i in failed:
                self._state[i] = _IDLE
            else:
                self._state[i] = _READY
                self._ready.append(i)
        if reply.failures:
            return reply.failures[0].to_error(worker, self._env_name)
        return error

    def _write_rows(self, rows: Rows) -> None:
        batch, ids = self._batch, rows.env_ids
        if isinstance(batch.observations, list):
            for k, i in enumerate(ids.tolist()):
                batch.observations[i] = rows.observations[k]
        else:
            put(self.single_observation_space, batch.observations, ids, rows.observations)
        batch.rewards[ids] = rows.rewards
        batch.terminations[ids] = rows.terminations
        batch.truncations[ids] = rows.truncations

    def _lost(self, worker: int, lost: WorkerLost) -> EnvError | None:
        """A worker died (or was killed for hanging): raise, or restart it and resend."""
        ids = self._assignment[worker]
        in_flight = [i for i in ids if self._state[i] == _IN_FLIGHT]
        command = self._pending[worker][0] if self._pending[worker] else None
        phase = {Step: Phase.STEP, Reset: Phase.RESET}.get(type(command), Phase.CALL)
        hung = self._hung.pop(worker, None)
        kind = EnvTimeoutError if hung is not None else WorkerDiedError
        reason = (
            f"no reply after {hung:.3g}s (step_timeout={self.step_timeout}); killed"
            if hung is not None
            else lost.reason
        )
        error = kind(
            f"worker {worker} holding envs {list(ids)} ({self._env_name}) "
            f"{'hung' if hung is not None else 'died'} during {phase.value} ({reason}); "
            f"envs in flight: {in_flight}",
            env_index=in_flight[0] if in_flight else None,
            phase=phase,
            worker=worker,
            exitcode=lost.exitcode,
            env_ids=ids,
        )
        resend = self._drop_pending(worker)
        if self.on_error is OnError.RAISE or self._draining:
            return error
        self._restarts[list(ids)] += 1
        over = [i for i in ids if self._restarts[i] > self.max_restarts]
        if over:
            return self._restart_limit(over[0], worker, error)
        try:
            self._transport.restart(worker, {i: int(self._restarts[i]) for i in ids})
        except EnvError as exc:  # the replacement could not even build its envs
            return exc
        for command in resend:
            self._submit(worker, command)
        return None

    def _drop_pending(self, worker: int) -> list[Command]:
        """Forget a lost worker's commands (its envs go idle); return those worth resending."""
        resend: list[Command] = [c for c in self._pending[worker] if not isinstance(c, Close)]
        for command in self._pending[worker]:
            if command.delivers_envs:
                ids = command.env_ids  # type: ignore[union-attr]
                self._state[self._index(ids)] = _IDLE
                self._in_flight -= len(ids)
        self._pending[worker].clear()
        return resend

    def _count_restarts(self, worker: int, failures: tuple[EnvFailure, ...]) -> EnvError | None:
        for failure in failures:
            i = failure.env_index
            if i is None:
                continue
            self._restarts[i] += 1
            if self._restarts[i] > self.max_restarts:
                return self._restart_limit(i, worker, failure.to_error(worker, self._env_name))
        return None

    def _restart_limit(self, env: int, worker: int, cause: EnvError) -> EnvError:
        error = RestartLimitError(
            f"env {env} ({self._env_name}) failed {int(self._restarts[env])} times, more than "
            f"max_restarts={self.max_restarts}; last failure: {cause}",
            env_index=env,
            phase=cause.phase,
            worker=worker,
        )
        error.__cause__ = cause
        return error

    def _wait_timeout(self) -> float | None:
        if self.step_timeout is None:
            return None
        busy = [
            since for since, pending in zip(self._busy_since, self._pending, strict=True) if pending
        ]
        if not busy:
            return None
        return max(0.0, min(busy) + self.step_timeout - time.monotonic())

    def _kill_hung_workers(self) -> None:
        assert self.step_timeout is not None
        now = time.monotonic()
        for worker, pending in enumerate(self._pending):
            if pending and worker not in self._hung:
                waited = now - self._busy_since[worker]
                if waited >= self.step_timeout:
                    self._hung[worker] = waited
                    self._transport.kill(worker)

    def _fail(self, error: EnvError) -> None:
        """Break the pool, gather what other envs completed onto the error, and raise it."""
        self._broken = error
        self._draining = True
        try:
            limit = min(DRAIN_TIMEOUT, self.step_timeout or DRAIN_TIMEOUT)
            deadline = time.monotonic() + limit
            while (self._state == _IN_FLIGHT).any():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for worker, reply in self._transport.wait(remaining):
                    self._take(worker, reply)
            if self._ready:
                ready = np.array(self._ready)
                self._ready.clear()
                self._state[ready] = _IDLE
                error.completed = self._results(ready, with_env_id=True)
        except Exception:
            pass  # the original error matters more than what could not be gathered
        finally:
            self._draining = False
        raise error

    def _check_usable(self) -> None:
        if self.closed:
            raise ClosedPoolError(f"this pool of {self._env_name} is closed")
        if self._broken is not None:
            raise BrokenPoolError(
                f"this pool of {self._env_name} is broken by an earlier failure "
                f"({self._broken}); close() it and make a new one"
            ) from self._broken

    def _idle_ids(self, env_id: Sequence[int] | np.ndarray | None, what: str) -> np.ndarray:
        if env_id is None and not self._state.any():  # every env, all idle: the sync step
            return self._all_ids
        env_ids = check_env_ids(env_id, self.num_envs)
        busy = env_ids[self._state[env_ids] != _IDLE]
        if busy.size:
            raise AlreadyPendingError(
                f"{what}: envs {busy.tolist()} already have a step or result pending; "
                "recv() their results first"
            )
        return env_ids

    def _by_worker(self, env_ids: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
        if len(env_ids) == self.num_envs:
            return list(enumerate(self._assignment))
        workers = self._worker_of[env_ids]
        order = np.argsort(workers, kind="stable")
        groups: list[tuple[int, tuple[int, ...]]] = []
        for worker in np.unique(workers).tolist():
            ids = env_ids[order][workers[order] == worker]
            groups.append((worker, tuple(sorted(ids.tolist()))))
        return groups

    def _seeds_for(
        self, seed: int | Sequence[int | None] | None, env_ids: np.ndarray, per_env: int
    ) -> list[int | None]:
        if seed is None:  # the pool's seed, until a reset has been sent (_submit_reset)
            seed = self._first_seed
        if seed is None:
            return [None] * len(env_ids)
        if isinstance(seed, int | np.integer) and not isinstance(seed, bool):
            if seed < 0:
                raise ValueError(f"seed must be a non-negative int, got {seed}")
            return [int(seed) + int(i) for i in env_ids]
        if isinstance(seed, str | bytes) or not isinstance(seed, Iterable):
            raise TypeError(f"seed must be None, an int or one int (or None) per env, got {seed!r}")
        seeds = list(seed)
        if len(seeds) != per_env:
            raise ValueError(f"expected {per_env} seeds (one per env), got {len(seeds)}")
        for k, s in enumerate(seeds):
            if s is None:
                continue
            if isinstance(s, bool) or not isinstance(s, int | np.integer):
                raise TypeError(f"seed[{k}] must be an int or None, got {s!r}")
            if s < 0:
                raise ValueError(f"seed[{k}] must be a non-negative int, got {s}")
        seeds = [None if s is None else int(s) for s in seeds]
        if per_env == self.num_envs:
            return [seeds[i] for i in env_ids]
        return seeds

    def _check_reset_mask(self, mask: Any) -> np.ndarray:
        if not isinstance(mask, np.ndarray):
            raise TypeError(f"options['reset_mask'] must be a numpy array, got {type(mask)}")
        if mask.shape != (self.num_envs,):
            raise ValueError(
                f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}"
            )
        if mask.dtype != np.bool_:
            raise TypeError(f"options['reset_mask'] must have dtype bool, got {mask.dtype}")
        if not mask.any():
            raise ValueError("options['reset_mask'] must select at least one env")
        return mask

    def __repr__(self) -> str:
        return (
            f"Pool({self._env_name}, num_envs={self.num_envs}, workers={len(self._assignment)}, "
            f"batch_size={self.batch_size})"
        )


def _check_options(options: Any) -> dict[str, Any] | None:
    """``reset``'s ``options`` as a new dict (``None`` stays ``None``)."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options must be a dict (of keyword options for each env's reset) or None, "
            f"got {type(options).__name__} {options!r}"
        )
    return dict(options)


__all__ = ["EnvState", "Pool"]
