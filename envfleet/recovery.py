"""Recovery: what a pool does when an env fails, a worker dies or hangs.

Recovery decides; it never speaks to the workers. The pool's dispatch
(:class:`~envfleet.dispatch.Dispatch`, the one owner of the conversation with the workers)
hands it every reply, and carries out what it answers::

    dispatch ── take(worker, reply) ──► recovery ── books it in the ledger (its verbs) ──►
             ◄─ an EnvError, a Rebuild (restart this worker, resend what it owed), or None
    dispatch ── hung() ──► recovery ── the workers past step_timeout, to kill
    dispatch ── over_limit(memory) / recycle(worker) ──► the workers to replace for memory

What goes wrong becomes an :class:`~envfleet.EnvError`:

- an env that raised: the failure its group reported (the group restarted it already under
  ``on_error="restart"``; recovery counts those restarts against ``max_restarts``);
- a lost worker (:class:`~envfleet.backends.WorkerLost`: it died, or was killed for hanging
  past ``step_timeout``): under ``"raise"`` an error naming its envs; under ``"restart"`` a
  :class:`Rebuild` (the dispatch has the worker rebuilt and resends what it owed);
- a worker over ``worker_memory_limit``, between its own commands: replaced (recycled), its
  envs restarted; recycles are counted apart from restarts and never against ``max_restarts``.

A worker is judged hung on its own time: the spans the pool spent rebuilding other workers
(reading no reply) do not count (:meth:`rebuilt`), and the dispatch reads the replies that
arrived before it asks :meth:`hung`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from envfleet.backends import WorkerLost
from envfleet.errors import (
    EnvError,
    EnvTimeoutError,
    OnError,
    Phase,
    RestartLimitError,
    WorkerDiedError,
)
from envfleet.ledger import Ledger
from envfleet.protocol import Command, EnvCommand, EnvFailure, Reply

DEFAULT_MAX_RESTARTS = 100
MEMORY_CHECK_INTERVAL = 1.0
"""Seconds between checks of the workers' memory against ``worker_memory_limit``."""
DRAIN_TIMEOUT = 5.0
"""Seconds a failing call waits for the other envs' results, gathered on the error."""
HUNG_POLL = 0.05
"""Seconds the pool blocks at a time while a worker killed for hanging is not yet reported lost."""


@dataclass(frozen=True)
class Rebuild:
    """Recovery's answer to a lost (or recycled) worker: rebuild it, its envs restarted with
    these counts (``rebuilds``: per env, how often it was rebuilt so far), then resend what it
    owed (``resend``, in order)."""

    worker: int
    rebuilds: dict[int, int]
    resend: tuple[Command, ...] = ()


class Recovery:
    """Failures, lost and hung workers, restarts and their limits for one pool.

    Args:
        ledger: the pool's ledger.
        env_name: the env's name, for messages.
        on_error: the failure policy.
        step_timeout: seconds a worker may owe a reply before it is killed (``None``: never).
        max_restarts: restarts allowed per env.
        worker_memory_limit: bytes of memory a worker may use (``None``: no limit).
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        env_name: str,
        on_error: OnError = OnError.RAISE,
        step_timeout: float | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        worker_memory_limit: int | None = None,
    ) -> None:
        self.ledger = ledger
        self.env_name = env_name
        self.on_error = on_error
        self.step_timeout = step_timeout
        self.max_restarts = max_restarts
        self.worker_memory_limit = worker_memory_limit
        self.restarts = np.zeros(ledger.num_envs, dtype=np.int64)
        """How many times each env was restarted."""
        self.recycled = [0] * ledger.num_workers
        """How many times each worker was replaced for its memory."""
        # Per env, how often it was rebuilt by a recycle: with ``restarts``, the count a
        # replacement worker continues (its restarted envs' seeds derive from it).
        self._recycled_envs = np.zeros(ledger.num_envs, dtype=np.int64)
        self._over_limit: set[int] = set()  # workers seen over the limit, not yet replaced
        self.broken: BaseException | None = None
        """The error that broke the pool, if one did."""
        self.draining = False
        """Set while a failing call gathers the other envs' results: no more rebuilds."""
        self._hung: dict[int, float] = {}  # workers killed for hanging: how long they hung
        # Spans (start, end) the pool spent rebuilding a worker, reading no reply: they do not
        # count against the other workers' step_timeout (their replies may sit unread).
        self._deaf: list[tuple[float, float]] = []
        self._memory_checked = time.monotonic()

    # -- each reply ----------------------------------------------------------------------------

    def take(self, worker: int, reply: Reply | WorkerLost | None) -> EnvError | Rebuild | None:
        """Book one reply in the ledger; return the error it reports, or the rebuild a lost
        worker needs, if any."""
        if isinstance(reply, WorkerLost):
            return self.lost(worker, reply)
        command = self.ledger.took(worker, reply)
        if reply is None:
            return None
        error = self._count_restarts(worker, reply.restarts) if reply.restarts else None
        if isinstance(command, EnvCommand) and reply.failures:
            failure = reply.failures[0]
            if failure.env_index is None and failure.phase is not command.phase:
                # The command failed as a whole, before any env (the worker could not read
                # it, say): it names the phase of the command.
                failure = dataclasses.replace(failure, phase=command.phase)
            return failure.to_error(worker, self.env_name)
        return error

    def lost(self, worker: int, lost: WorkerLost) -> EnvError | Rebuild:
        """A worker died (or was killed for hanging): the error, or the rebuild it needs."""
        ledger = self.ledger
        ids = ledger.assignment[worker]
        in_flight = ledger.in_flight_of(worker)
        command = ledger.pending[worker][0] if ledger.pending[worker] else None
        phase = command.phase if command is not None else Phase.CALL
        hung = self._hung.pop(worker, None)
        kind = EnvTimeoutError if hung is not None else WorkerDiedError
        reason = (
            f"no reply after {hung:.3g}s (step_timeout={self.step_timeout}); killed"
            if hung is not None
            else lost.reason
        )
        error = kind(
            f"worker {worker} holding envs {list(ids)} ({self.env_name}) "
            f"{'hung' if hung is not None else 'died'} during {phase.value} ({reason}); "
            f"envs in flight: {in_flight}",
            env_index=in_flight[0] if in_flight else None,
            phase=phase,
            worker=worker,
            exitcode=lost.exitcode,
            env_ids=ids,
        )
        resend = ledger.dropped(worker)
        if self.on_error is OnError.RAISE or self.draining:
            return error
        self.restarts[list(ids)] += 1
        over = [i for i in ids if self.restarts[i] > self.max_restarts]
        if over:
            return self._restart_limit(over[0], worker, error)
        return Rebuild(worker, self._rebuilds(ids), tuple(resend))

    def rebuilt(self, start: float, end: float) -> None:
        """The pool spent ``start .. end`` rebuilding a worker, reading no reply."""
        self._deaf.append((start, end))

    def _count_restarts(self, worker: int, failures: tuple[EnvFailure, ...]) -> EnvError | None:
        for failure in failures:
            i = failure.env_index
            if i is None:
                continue
            self.restarts[i] += 1
            if self.restarts[i] > self.max_restarts:
                return self._restart_limit(i, worker, failure.to_error(worker, self.env_name))
        return None

    def _restart_limit(self, env: int, worker: int, cause: EnvError) -> EnvError:
        error = RestartLimitError(
            f"env {env} ({self.env_name}) failed {int(self.restarts[env])} times, more than "
            f"max_restarts={self.max_restarts}; last failure: {cause}",
            env_index=env,
            phase=cause.phase,
            worker=worker,
        )
        error.__cause__ = cause
        return error

    # -- hung workers --------------------------------------------------------------------------

    def _deaf_since(self, since: float, now: float) -> float:
        """Seconds of ``since .. now`` the pool spent rebuilding workers, reading nothing."""
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in self._deaf)

    def _due(self, worker: int, now: float) -> float:
        """When ``worker``'s pending command is past ``step_timeout``: its own time, not
        counting the spans the pool spent rebuilding other workers."""
        assert self.step_timeout is not None
        since = self.ledger.busy_since[worker]
        allowed = self.step_timeout * self.ledger.allowance(worker)
        return since + allowed + self._deaf_since(since, now)

    def wait_timeout(self) -> float | None:
        """How long the pool may block waiting before the oldest busy worker is past
        ``step_timeout`` (``None``: no limit)."""
        if self.step_timeout is None:
            return None
        ledger, hung = self.ledger, self._hung
        now = time.monotonic()
        busy = [
            # A worker killed for hanging: its loss wakes the wait when it comes (a stopped
            # Ray actor takes Ray seconds to kill); until then, waits of HUNG_POLL, not a spin.
            now + HUNG_POLL if worker in hung else self._due(worker, now)
            for worker, pending in enumerate(ledger.pending)
            if pending
        ]
        if not busy:
            return None
        return max(0.0, min(busy) - now)

    def overdue(self) -> bool:
        """Whether a worker not yet killed owes a reply past its ``step_timeout``.

        The dispatch then reads the replies that have arrived (:meth:`take`) before
        :meth:`hung` judges anyone: a reply that waits unread is no hang.
        """
        if self.step_timeout is None:
            return False
        now = time.monotonic()
        return any(
            pending and worker not in self._hung and now >= self._due(worker, now)
            for worker, pending in enumerate(self.ledger.pending)
        )

    def hung(self) -> list[int]:
        """The workers that have owed a reply for ``step_timeout`` (the spans the pool spent
        rebuilding other workers not counted), each named once: the dispatch kills them, the
        transport then reports them lost, and :meth:`lost` names them hung. Ask once the
        replies that arrived were taken."""
        assert self.step_timeout is not None
        now = time.monotonic()
        ledger = self.ledger
        oldest = now
        killed = []
        for worker, pending in enumerate(ledger.pending):
            if pending and worker not in self._hung:
                since = ledger.busy_since[worker]
                oldest = min(oldest, since)
                if now >= self._due(worker, now):
                    self._hung[worker] = now - since - self._deaf_since(since, now)
                    killed.append(worker)
        # Spans that ended before every pending command began count for none of them.
        self._deaf = [span for span in self._deaf if span[1] > oldest]
        return killed

    # -- memory --------------------------------------------------------------------------------

    def over_limit(self, memory: Callable[[int], int | None]) -> list[int]:
        """The workers to replace for their memory, lowest first: ``memory(worker)`` (its
        resident bytes) is read at most once per :data:`MEMORY_CHECK_INTERVAL`; a worker seen
        over ``worker_memory_limit`` stays listed until :meth:`recycle` replaced it.

        A leaking env would otherwise grow until the machine runs out; its envs restart as
        after a failure (their episodes reported truncated, ``infos["envfleet/restarted"]``).
        """
        limit = self.worker_memory_limit
        if limit is None:
            return []
        now = time.monotonic()
        if now - self._memory_checked >= MEMORY_CHECK_INTERVAL:
            self._memory_checked = now
            for worker in range(self.ledger.num_workers):
                used = memory(worker)
                if used is not None and used > limit:
                    self._over_limit.add(worker)
        return sorted(self._over_limit)

    def recycle(self, worker: int) -> Rebuild:
        """Replace ``worker`` (over the limit, owing nothing): counted in ``recycled``, never
        against ``max_restarts``."""
        self._over_limit.discard(worker)
        ids = self.ledger.assignment[worker]
        self._recycled_envs[list(ids)] += 1
        self.recycled[worker] += 1
        return Rebuild(worker, self._rebuilds(ids))

    def _rebuilds(self, ids: tuple[int, ...]) -> dict[int, int]:
        """How often each of ``ids`` was rebuilt (restarts and recycles): a replacement worker
        continues these counts, and restarted envs' seeds derive from them."""
        return {i: int(self.restarts[i] + self._recycled_envs[i]) for i in ids}


__all__ = ["DEFAULT_MAX_RESTARTS", "DRAIN_TIMEOUT", "Rebuild", "Recovery"]
