"""Dispatch: the pool's side of the conversation with its workers, and its only speaker.

The face (:class:`~envfleet.Pool`) checks what the caller asks and says what to send; the
dispatch turns it into commands per worker, sends them and takes the replies in. It alone calls
the transport (the conversation) and its workers (their lifecycle: kill, restart, memory,
close); recovery decides what a reply means and hands back what to do, and the ledger changes
only through its own verbs::

    face ──► submit_step / submit_reset / call ──► ledger (sent) ──► transport (to the workers)
    face ◄── collect / first_ready ◄── pump ◄── recovery.take (ledger took; an error, or a
                                                Rebuild the dispatch carries out) ◄──
                                                transport.wait (rows already in the batch)
             pump ── recovery.overdue? read what arrived first ── recovery.hung ── kill

Every command of a call is serialised before the first is sent (a call that fails on the
caller's side leaves the pool as it was), and every wait is bounded by recovery's timeout. The
dispatch keeps no strong reference to the face, so that a pool dropped unclosed still closes
itself at once (its ``__del__``) rather than when the garbage collector breaks a cycle: it holds
the face's ``gather`` weakly and is told when the pool closes.

What only some transports have (spare observation rows, nodes, several commands in one message,
rollout parts read into the pool's arrays: :class:`~envfleet.backends.HasSpares`,
:class:`~envfleet.backends.HasNodes`, :class:`~envfleet.backends.SubmitsMany`,
:class:`~envfleet.backends.LandsParts`) is looked up once, when the dispatch is made.
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envfleet.backends import HasNodes, HasSpares, LandsParts, SubmitsMany, Transport
from envfleet.errors import ClosedPoolError, EnvError
from envfleet.ledger import Ledger
from envfleet.protocol import Call, Command, Reply, Reset, Sample, SetAttr, Step
from envfleet.recovery import DRAIN_TIMEOUT, Rebuild, Recovery
from envfleet.rollout_loop import Sampled

_worker_of, _reply_of = operator.itemgetter(0), operator.itemgetter(1)  # of (worker, reply)


class Dispatch:
    """Sends a pool's commands to its workers and takes their replies in.

    Args:
        transport: the pool's transport (and, as its ``workers``, their lifecycle).
        ledger: the pool's ledger (told what is sent; what is in flight and ready).
        recovery: the pool's recovery (takes each reply; the failure policy).
        env_name: the env's name, for errors.
        gather: a method of the face giving the results of ready envs as ``recv`` returns
            them (put on a failure's error); held weakly.
    """

    def __init__(
        self,
        transport: Transport,
        ledger: Ledger,
        recovery: Recovery,
        env_name: str,
        gather: Callable[[np.ndarray], Any],
    ) -> None:
        self.closed = False
        self._transport = transport
        self._workers = transport.workers
        self.spares = transport.spares if isinstance(transport, HasSpares) else None
        """The transport's spare observation rows (``None``: it has none, the pool copies)."""
        self._nodes = transport.nodes if isinstance(transport, HasNodes) else None
        self._submit_many = (
            transport.submit_many if isinstance(transport, SubmitsMany) else self._submit_each
        )
        self._land = transport.land if isinstance(transport, LandsParts) else None
        self._ledger = ledger
        self._recovery = recovery
        self._env_name = env_name
        self._gather_method = weakref.WeakMethod(gather)
        self._num_envs = ledger.num_envs

    def close(self, timeout: float) -> None:
        """Close the workers; a wait in another thread then raises ``ClosedPoolError``."""
        self.closed = True
        self._workers.close(timeout)

    def _gather(self, env_ids: np.ndarray) -> Any:
        gather = self._gather_method()
        assert gather is not None  # the face is in use while its dispatch takes replies in
        return gather(env_ids)

    # -- what the face asks of the transport --------------------------------------------------

    def nodes(self) -> tuple[Any, ...]:
        """Per node, the transport's layout and traffic (empty: not node sub-pools)."""
        return () if self._nodes is None else self._nodes()

    def forked(self) -> None:
        """In a forked child: the transport's workers are the parent's."""
        self._workers.forked()

    # -- the workers' lifecycle ----------------------------------------------------------------

    def recycle_over_limit(self) -> None:
        """Replace each worker over ``worker_memory_limit`` (before a command is sent), between
        its own commands: if it still owes replies (async ``send``/``recv`` keeps a worker
        busy), they are taken in first, so its results stay ready for ``recv`` and nothing of
        it is in flight when it is replaced."""
        recovery, ledger = self._recovery, self._ledger
        for worker in recovery.over_limit(self._workers.memory):
            while ledger.pending[worker]:
                self.pump(True)
            error = self._rebuild(recovery.recycle(worker))
            if error is not None:  # the replacement could not build its envs
                self.fail(error)

    def _rebuild(self, rebuild: Rebuild) -> EnvError | None:
        """Have the workers rebuild one, then resend what it owed; the time it takes is
        told to recovery (no other worker's ``step_timeout`` counts it). Returns the error of
        a replacement that could not build its envs."""
        start = time.monotonic()
        try:
            self._workers.restart(rebuild.worker, rebuild.rebuilds)
        except EnvError as exc:
            return exc
        finally:
            self._recovery.rebuilt(start, time.monotonic())
        for command in rebuild.resend:
            self._ledger.sent(rebuild.worker, command)
            self._transport.submit(rebuild.worker, command)
        return None

    def _take(self, worker: int, reply: Any) -> EnvError | None:
        """One reply through recovery; a rebuild it asks for is carried out here."""
        verdict = self._recovery.take(worker, reply)
        if isinstance(verdict, Rebuild):
            return self._rebuild(verdict)
        return verdict

    def fail(self, error: EnvError) -> None:
        """Break the pool, gather what other envs completed onto the error, and raise it.

        The results of ready envs, as ``recv`` would return them, go on ``error.completed``;
        the replies still on their way are waited for (at most :data:`DRAIN_TIMEOUT`, or
        ``step_timeout`` if shorter), with no more rebuilds.
        """
        recovery, ledger = self._recovery, self._ledger
        recovery.broken = error
        recovery.draining = True
        try:
            limit = min(DRAIN_TIMEOUT, recovery.step_timeout or DRAIN_TIMEOUT)
            deadline = time.monotonic() + limit
            while ledger.any_in_flight(ledger.all_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for worker, reply in self._transport.wait(remaining):
                    self._take(worker, reply)
            ready = ledger.drain_ready()
            if ready is not None:
                error.completed = self._gather(ready)
        except Exception:
            pass  # the original error matters more than what could not be gathered
        finally:
            recovery.draining = False
        raise error

    # -- commands out --------------------------------------------------------------------------

    def submit_reset(
        self, env_ids: np.ndarray, seeds: list[int | None], options: dict[str, Any] | None
    ) -> None:
        """Send a reset of ``env_ids`` with ``seeds`` (one per env) and ``options``."""
        if self._recovery.worker_memory_limit is not None:
            self.recycle_over_limit()
        seed_of = dict(zip(env_ids.tolist(), seeds, strict=True))
        self.submit_many(
            [
                (worker, Reset(ids, tuple(seed_of[i] for i in ids), options))
                for worker, ids in self._ledger.by_worker(env_ids)
            ]
        )

    def submit_step(
        self, env_ids: np.ndarray, carried: Sequence[dict[int, Any]] | None, spare: bool = False
    ) -> None:
        """Send a step of ``env_ids``: their actions are in the batch (``carried`` is
        ``None``) or, per worker, in ``carried``, which its command carries.

        A step of every env with its actions in the batch (the sync step) is a whole-pool step:
        the ledger books it for all workers at once (:meth:`Ledger.sent_all`), so the pool's
        thread spends next to nothing per worker beyond handing the command over. ``spare``:
        the caller hands every env's observations out next; the workers copy them into one of
        the transport's spares, if it has one free.
        """
        if carried is not None or len(env_ids) != self._num_envs:
            self.submit_many(
                [
                    (worker, Step(ids, carried[worker] if carried is not None else None))
                    for worker, ids in self._ledger.by_worker(env_ids)
                ]
            )
            return
        ledger, transport = self._ledger, self._transport
        if ledger.sent_all():
            if spare and self.spares is not None:
                self.spares.arm()
            transport.submit_all(ledger.step_all)
            return
        submit = transport.submit
        for worker, command in enumerate(ledger.step_all):
            submit(worker, command)

    def submit_many(self, commands: Sequence[tuple[int, Command]], pickles: bool = False) -> None:
        """Submit ``(worker, command)`` pairs, each serialised before the first is sent (unless
        the caller knows they all pickle: ``pickles``)."""
        if not pickles:
            prepare = self._transport.prepare
            for worker, command in commands:
                prepare(worker, command)
        sent = self._ledger.sent
        for worker, command in commands:
            sent(worker, command)
        self._submit_many(commands)  # a node sub-pool's in one message per node

    def land(self, worker: int, command: Sample, into: Sampled) -> None:
        """Have the transport read the part that answers ``command`` into ``into``'s arrays,
        if it can (:class:`~envfleet.backends.LandsParts`); else the part comes in its own."""
        if self._land is not None:
            self._land(worker, command, into)

    def _submit_each(self, commands: Sequence[tuple[int, Command]]) -> None:
        """A transport without :class:`~envfleet.backends.SubmitsMany`: one command at a time."""
        submit = self._transport.submit
        for worker, command in commands:
            submit(worker, command)

    def collect(self, env_ids: np.ndarray) -> None:
        """Wait until every env of ``env_ids`` is ready and take them out of the FIFO."""
        ledger = self._ledger
        if len(env_ids) == self._num_envs:
            while ledger.in_flight:  # block, for every reply owed, collecting
                self.pump(True, ledger.replies_owed(), True)
        else:
            while ledger.any_in_flight(env_ids):
                self.pump(block=True)
        ledger.collected(env_ids)

    def first_ready(self, count: int) -> np.ndarray:
        """Wait until ``count`` envs are ready and hand out the first ``count`` of the FIFO."""
        ledger, pump = self._ledger, self.pump
        while ledger.num_ready < count:
            pump(block=True)
        return ledger.handed_out(count)

    def call(self, commands: Sequence[Call | SetAttr]) -> tuple[Any, ...]:
        """Send ``commands`` (one per worker) and return one value per env."""
        values: dict[int, Any] = {}
        failures = []
        for worker, reply in enumerate(self.replies(commands)):
            values.update(reply.values or {})
            failures += [(worker, f) for f in reply.failures]
        if failures:
            worker, failure = failures[0]
            raise failure.to_error(worker, self._env_name)
        return tuple(values.get(i) for i in range(self._num_envs))

    def replies(
        self, commands: Sequence[Call | SetAttr | Sample], pickles: bool = False
    ) -> list[Reply]:
        """Send ``commands`` (one per worker, in order) and return their replies, in order.

        ``pickles``: the caller knows every command pickles (a rollout's: its policy is bytes
        already), so they are not serialised once more before the first is sent."""
        self.submit_many(list(enumerate(commands)), pickles)
        ledger, answers = self._ledger, self._ledger.answers
        while not ledger.answered(commands):  # woken once every reply is in, not at each
            self.pump(block=True, want=sum(command not in answers for command in commands))
        return [ledger.answer(command) for command in commands]

    def pump(
        self,
        block: bool,
        want: int = 1,
        collecting: bool = False,
        limit: float | None = None,
    ) -> None:
        """Take in the replies that have arrived (waiting for at least one if ``block``).

        ``want`` tells the transport how many replies are worth waking up for: a sync step waits
        for every pending command anyway. ``collecting``: every env is handed out once all are
        in (:meth:`collect` of the whole pool), so a whole-pool step's plain replies take its
        envs straight back to idle, without the ready FIFO. ``limit``: seconds to block at
        most (the caller's own timeout).
        """
        recovery, ledger = self._recovery, self._ledger
        timeout = recovery.wait_timeout() if block else 0.0
        if limit is not None:
            timeout = limit if timeout is None else min(timeout, limit)
        first = None
        try:
            replies = self._transport.wait(timeout, want)
        except Exception as exc:
            if self.closed:  # by another thread while this one waited
                raise ClosedPoolError(f"this pool of {self._env_name} was closed") from exc
            raise
        if self.closed:  # by another thread: the replies are of envs being closed
            raise ClosedPoolError(f"this pool of {self._env_name} was closed while waiting")
        if (
            ledger.all_out is not None  # every worker's only pending command: a whole step
            and len(replies) == ledger.num_workers
            and not any(map(_reply_of, replies))  # all plain (a reply or a loss is truthy)
        ):
            ledger.took_all_plain(map(_worker_of, replies), collecting)
        else:
            take = self._take
            for worker, reply in replies:
                error = take(worker, reply)
                first = first or error
        if recovery.step_timeout is not None:
            first = self._judge_hung(first)
        if first is not None:
            self.fail(first)

    def _judge_hung(self, first: Any) -> Any:
        """Kill the workers past ``step_timeout``, once the replies that arrived are read.

        A reply that sat unread (the pool was rebuilding another worker, or took its replies
        late) is no hang: while a worker looks overdue, what the transport holds is taken in
        first, without waiting. Returns the first error reported, if any.
        """
        recovery = self._recovery
        for _ in range(self._ledger.num_workers + 1):  # each round takes replies; bounded
            if not recovery.overdue():
                break
            replies = self._transport.wait(0.0, 1)
            if not replies:
                break
            for worker, reply in replies:
                error = self._take(worker, reply)
                first = first or error
        for worker in recovery.hung():
            self._workers.kill(worker)
        return first


__all__ = ["Dispatch"]
