"""The ledger: where each env of a pool stands, and what each worker owes.

The pool's face (:mod:`envfleet.pool`) asks the ledger before it sends anything and tells it
what it sent; recovery (:mod:`envfleet.recovery`) tells it what came back. The ledger itself
never talks to a transport and never imports either of them: it is plain bookkeeping, testable
on its own (``tests/test_ledger.py``).

It keeps:

- one :class:`EnvState` per env: ``IDLE`` (its last result was handed out; it may be sent an
  action) → ``IN_FLIGHT`` (a step or reset was sent) → ``READY`` (its result is in the batch,
  waiting for ``recv``) → ``IDLE``; an env whose command failed goes back to ``IDLE``;
- per worker, the commands sent and not yet answered, oldest first (a worker answers in order,
  so a reply always answers the head of its queue);
- the ready envs in a FIFO, the order ``recv`` hands them out in (EnvPool's "first done");
- the infos of ready envs, until they are handed out, and the replies of calls (``call``,
  ``set_attr``), filed under the very command object that was sent.

Data flow of a step: face ``sent(worker, Step)`` → transport → reply → ``took(worker, reply)``
(envs READY, in the FIFO) → face hands envs out (``handed_out``) → IDLE.

The whole-pool step, the synchronous hot path, has its own two entries: :meth:`Ledger.sent_all`
marks every env in flight and every worker owing its part of one shared set of commands
(:attr:`Ledger.step_all`, built once), and :meth:`Ledger.took_all_plain` takes every worker's
plain reply at once, with no per-env Python loop.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from envfleet.info_columns import BatchedInfos, Columns
from envfleet.protocol import Close, Command, EnvCommand, Reply, Sample, Step, ValueCommand
from envfleet.stats import StatsRecorder


class EnvState(enum.IntEnum):
    """Where each env of the pool stands."""

    IDLE = 0  # its last result was handed to the caller; it may be sent an action
    IN_FLIGHT = 1  # a step or reset was sent; its result is not in yet
    READY = 2  # its result is in and waits for ``recv``


# Plain ints for the hot path (an Enum member lookup costs more than the comparison).
_IDLE, _IN_FLIGHT, _READY = int(EnvState.IDLE), int(EnvState.IN_FLIGHT), int(EnvState.READY)

INDEX_CACHE_SIZE = 4096
"""Index arrays kept for env-id tuples (the same tuples come back every step)."""


class Ledger:
    """Per-env states, commands pending per worker and the ready FIFO of one pool.

    Args:
        assignment: the env ids of each worker (disjoint; together ``0 .. num_envs - 1``).
        stats: where busy and reply times go (:meth:`envfleet.Pool.stats`).
    """

    def __init__(
        self,
        assignment: Sequence[tuple[int, ...]],
        stats: StatsRecorder,
        columns: Callable[[Columns], None] | None = None,
    ) -> None:
        self.assignment = [tuple(ids) for ids in assignment]
        self._columns = columns  # where infos that came as arrays go as columns: the batch's
        self.num_envs = sum(len(ids) for ids in self.assignment)
        self.num_workers = len(self.assignment)
        self.worker_of = np.empty(self.num_envs, dtype=np.intp)
        for worker, ids in enumerate(self.assignment):
            self.worker_of[list(ids)] = worker
        self.state = np.zeros(self.num_envs, dtype=np.int8)
        """One :class:`EnvState` value per env."""
        self.ready: deque[int] = deque()
        """Envs whose results are in, in the order they came."""
        self.infos: dict[int, dict[str, Any]] = {}
        """The non-empty infos of ready envs, until handed out."""
        self.pending: list[deque[Command]] = [deque() for _ in self.assignment]
        """Per worker, the commands sent and not answered, oldest first."""
        self.answers: dict[ValueCommand, Reply] = {}
        """Replies to calls, under the command sent."""
        self.busy_since = [0.0] * self.num_workers
        """Per worker, when its oldest pending command was sent (or last answered)."""
        self.in_flight = 0
        """Envs with a step or reset sent and no reply yet."""
        self.all_ids = np.arange(self.num_envs)
        self.all_ids.flags.writeable = False  # shared by every sync step: never handed out
        self.step_all = [Step(ids) for ids in self.assignment]
        """One whole-pool step, reused every step (a transport that pickles does so once)."""
        self.all_out: float | None = None
        """Set (to when it was sent) while every worker's only pending command is its part of
        a whole-pool step sent by :meth:`sent_all`: the replies can then be taken all at once
        (:meth:`took_all_plain`)."""
        self._stats = stats
        self._indices: dict[tuple[int, ...], np.ndarray] = {}

    # -- questions -----------------------------------------------------------------------------

    def index(self, ids: tuple[int, ...]) -> np.ndarray:
        """``ids`` as an index array (cached: the same tuples come back every step)."""
        index = self._indices.get(ids)
        if index is None:
            if len(self._indices) > INDEX_CACHE_SIZE:
                self._indices.clear()
            index = self._indices[ids] = np.array(ids, dtype=np.intp)
        return index

    def busy(self, env_ids: np.ndarray) -> np.ndarray:
        """Those of ``env_ids`` that are not idle."""
        busy: np.ndarray = env_ids[self.state[env_ids] != _IDLE]
        return busy

    def owed(self) -> int:
        """Envs in flight or ready (what ``recv`` may still hand out)."""
        return int(np.count_nonzero(self.state != _IDLE))

    def all_idle(self) -> bool:
        """Whether no env is in flight or ready (the pool may send a whole-pool step).

        Read from the counters, not the states: the envs in flight are counted, and the ready
        ones are those in the FIFO (every entry below keeps both in step with :attr:`state`).
        """
        return not self.in_flight and not self.ready

    @property
    def num_ready(self) -> int:
        """Envs whose results are in and not handed out."""
        return len(self.ready)

    def replies_owed(self) -> int:
        """Replies the pool waits for until nothing is in flight: one per worker when a
        whole-pool step is out, else one per pending command."""
        if self.all_out is not None:
            return self.num_workers
        return sum(map(len, self.pending))

    def answered(self, commands: Sequence[ValueCommand]) -> bool:
        """Whether every one of ``commands`` (calls) has its reply in."""
        answers = self.answers
        return all(command in answers for command in commands)

    def answer(self, command: ValueCommand) -> Reply:
        """The reply to ``command`` (a call), handed over once."""
        return self.answers.pop(command)

    def take_infos(
        self, env_ids: Iterable[int], positions: Iterable[int]
    ) -> list[tuple[dict[str, Any] | None, int]] | None:
        """The infos of ``env_ids`` (handed over once), each with its position in the batch;
        ``None`` when no env has any (the common case)."""
        infos = self.infos
        if not infos:
            return None
        pop = infos.pop
        ids = env_ids.tolist() if isinstance(env_ids, np.ndarray) else list(map(int, env_ids))
        places = positions.tolist() if isinstance(positions, np.ndarray) else positions
        return [(pop(i, None), int(p)) for i, p in zip(ids, places, strict=False)]

    def by_worker(self, env_ids: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
        """``env_ids`` grouped by the worker holding them, each group sorted."""
        if len(env_ids) == self.num_envs:
            return list(enumerate(self.assignment))
        workers = self.worker_of[env_ids]
        order = np.argsort(workers, kind="stable")
        groups: list[tuple[int, tuple[int, ...]]] = []
        for worker in np.unique(workers).tolist():
            ids = env_ids[order][workers[order] == worker]
            groups.append((worker, tuple(sorted(ids.tolist()))))
        return groups

    def allowance(self, worker: int) -> int:
        """How many steps' time ``worker``'s oldest pending command may take (a rollout's
        steps; else 1): ``step_timeout`` bounds each step."""
        pending = self.pending[worker]
        return pending[0].steps if pending and isinstance(pending[0], Sample) else 1

    def idle_worker(self, worker: int) -> bool:
        """Whether ``worker`` owes nothing and none of its envs is in flight or unread."""
        ids = self.assignment[worker]
        return not self.pending[worker] and not (self.state[list(ids)] != _IDLE).any()

    # -- what the face sends -------------------------------------------------------------------

    def sent(self, worker: int, command: Command) -> None:
        """``command`` was handed to ``worker``: its envs (if it delivers any) are in flight."""
        self.all_out = None
        if isinstance(command, EnvCommand):
            ids = command.env_ids
            self.state[self.index(ids)] = _IN_FLIGHT
            self.in_flight += len(ids)
        if not self.pending[worker]:
            now = time.monotonic()
            self.busy_since[worker] = now
            self._stats.busy(worker, now)
        self.pending[worker].append(command)

    def sent_all(self) -> bool:
        """:attr:`step_all` goes to every worker (every env idle: the sync step).

        Returns whether the workers owed nothing before, so that their replies may be taken
        all at once (:meth:`took_all_plain`) and a transport may hand the commands over at once.
        """
        now = time.monotonic()
        self.state.fill(_IN_FLIGHT)
        self.in_flight += self.num_envs
        pending = self.pending
        if any(pending):  # a worker still owes a reply (not after the usual sync step)
            self.all_out = None
            for worker, command in enumerate(self.step_all):
                if not pending[worker]:
                    self.busy_since[worker] = now
                    self._stats.busy(worker, now)
                pending[worker].append(command)
            return False
        self.all_out = now
        self.busy_since = [now] * self.num_workers
        self._stats.busy_all(now)
        for queue, command in zip(pending, self.step_all, strict=True):
            queue.append(command)
        return True

    # -- what comes back -----------------------------------------------------------------------

    def took_all_plain(self, workers: Iterable[int], collected: bool = False) -> None:
        """Every worker answered its part of a whole-pool step with nothing to report.

        Each worker had exactly that one command pending (:attr:`all_out`), and as many
        replies as workers came in, so each worker answered once. ``workers`` is the order the
        replies came in, which async ``recv`` hands envs out in. ``collected``: every env is
        handed out at once as well (the sync step), so they go straight back to idle.
        """
        started, self.all_out = self.all_out, None
        assert started is not None
        now = time.monotonic()
        for queue in self.pending:
            queue.popleft()
        self.busy_since = [now] * self.num_workers
        self._stats.replied_all(started, now)
        self.in_flight -= self.num_envs
        if collected:
            self.state.fill(_IDLE)
            return
        self.state.fill(_READY)
        ready, assignment = self.ready, self.assignment
        for worker in workers:
            ready.extend(assignment[worker])

    def took(self, worker: int, reply: Reply | None) -> Command:
        """``worker`` answered its oldest command with ``reply`` (``None``: plain success).

        The envs it delivered are ready, in the FIFO (those it reports failed go idle); a
        call's reply is filed in :attr:`answers`. Returns the command answered.
        """
        self.all_out = None
        pending = self.pending[worker]
        command = pending.popleft()
        now = time.monotonic()
        steps = len(command.env_ids) if isinstance(command, Step) else 0
        started = self.busy_since[worker]
        if isinstance(command, Sample):  # a rollout: its env-steps, and its latency per step
            steps = len(command.env_ids) * command.steps
            started = now - (now - started) / command.steps
        self._stats.replied(worker, started, now, steps, not pending)
        self.busy_since[worker] = now
        if not isinstance(command, EnvCommand):
            if isinstance(command, ValueCommand):
                self.answers[command] = reply if reply is not None else Reply()
            return command
        ids = command.env_ids
        self.in_flight -= len(ids)
        if reply is not None and reply.infos:
            if self._columns is not None and isinstance(reply.infos, BatchedInfos):
                self._columns(reply.infos.columns())  # no dict per env
            else:
                self.infos.update(reply.infos)
        if reply is None or not reply.failures:  # every env delivered: the common case
            self.state[self.index(ids)] = _READY
            self.ready.extend(ids)
            return command
        failed = {f.env_index for f in reply.failures}
        if None in failed and not reply.env_ids:  # the command failed as a whole: no env ran
            failed = set(ids)
        for i in ids:
            if i in failed:
                self.state[i] = _IDLE
            else:
                self.state[i] = _READY
                self.ready.append(i)
        return command

    def dropped(self, worker: int) -> list[Command]:
        """``worker`` was lost: forget what it owed (its envs go idle); return what to resend."""
        self.all_out = None
        resend: list[Command] = []
        for command in self.pending[worker]:
            if isinstance(command, EnvCommand):
                ids = command.env_ids
                self.state[self.index(ids)] = _IDLE
                self.in_flight -= len(ids)
            if not isinstance(command, Close):
                resend.append(command)
        self.pending[worker].clear()
        return resend

    # -- what the face hands out ---------------------------------------------------------------

    def handed_out(self, count: int) -> np.ndarray:
        """The first ``count`` ready envs, now idle (the caller made sure they are ready)."""
        env_ids = np.array([self.ready.popleft() for _ in range(count)])
        self.state[env_ids] = _IDLE
        return env_ids

    def collected(self, env_ids: np.ndarray) -> None:
        """``env_ids`` (all ready) are handed out together, whatever their place in the FIFO."""
        if len(env_ids) == self.num_envs:
            if self.ready:  # else every env is idle already (took_all_plain collected them)
                self.ready.clear()
                self.state.fill(_IDLE)
            return
        wanted = set(env_ids.tolist())
        self.ready = deque(i for i in self.ready if i not in wanted)
        self.state[env_ids] = _IDLE

    def any_in_flight(self, env_ids: np.ndarray | None = None) -> bool:
        """Whether any env (of ``env_ids``, default all) is still in flight."""
        if env_ids is None:
            return bool(self.in_flight)
        return bool((self.state[env_ids] == _IN_FLIGHT).any())

    def in_flight_of(self, worker: int) -> list[int]:
        """The envs of ``worker`` in flight."""
        return [i for i in self.assignment[worker] if self.state[i] == _IN_FLIGHT]

    def snapshot(self) -> dict[str, Any]:
        """Where the pool stands, as plain values (read-only; for a stall report): per worker
        the commands sent and not answered (``Step(0, 1)``), and the envs in flight and ready."""
        return {
            "pending_per_worker": [
                [f"{type(c).__name__}{tuple(getattr(c, 'env_ids', ()))}" for c in list(queue)]
                for queue in self.pending
            ],
            "envs_in_flight": np.flatnonzero(self.state == _IN_FLIGHT).tolist(),
            "envs_ready": [int(i) for i in list(self.ready)],
        }

    def drain_ready(self) -> np.ndarray | None:
        """Every ready env, now idle (``None`` if none): what a failing call gathers."""
        if not self.ready:
            return None
        ready = np.array(self.ready)
        self.ready.clear()
        self.state[ready] = _IDLE
        return ready


__all__ = ["EnvState", "Ledger"]
