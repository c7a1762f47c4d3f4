"""The pool's rollouts: one :class:`~envfleet.protocol.Sample` per worker out, one
:class:`~envfleet.Rollout` in (:mod:`envfleet.rollouts` draws the whole flow).

The pool holds one :class:`PoolRollouts` and hands ``rollout`` to it. Before anything is sent,
it checks that a rollout can run (``steps``, the policy, spaces laid out as arrays, every env
idle and reset) and pickles the policy once for every worker; the dispatch sends the commands
and takes the replies in; the workers' parts are then assembled column block by column block,
and the pool's rows, reset flags and statistics are left as after the steps::

    rollout(policy, T) ── checks, policy pickled once ──► dispatch.replies(Sample per worker)
                          Out (T, its envs, ...) made; each part's columns given to the
                          transport, which reads the part there if it can (node sub-pools)
    Rollout ◄── Out ◄── each worker's Sampled (copied in unless read there); batch rows and
                episodes.needs_reset as after T steps; stats told the episodes ended
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.batch_rows import row_index
from envfleet.buffers import Batch, is_array_space, put, take
from envfleet.dispatch import Dispatch
from envfleet.episodes import Episodes
from envfleet.errors import AlreadyPendingError, NoPendingError
from envfleet.ledger import Ledger
from envfleet.lifecycle import Lifecycle
from envfleet.protocol import EnvFailure, Reply, Sample
from envfleet.recovery import Recovery
from envfleet.rollout_loop import Sampled, tree
from envfleet.rollout_parts import (
    QUEUED_MOST,
    Part,
    RolloutParts,
    check_max_lag,
    check_min_envs,
    check_timeout,
)
from envfleet.rollouts import Out, Policy, Rollout, relabelled
from envfleet.shipping import Shipper
from envfleet.stats import StatsRecorder
from envfleet.validation import check_env_ids


class PoolRollouts:
    """Runs one pool's rollouts.

    Args:
        life: the pool's lifecycle (the first check of every rollout).
        episodes: which envs were never reset; told which ended their episode.
        dispatch: what sends the commands and takes the replies in.
        ledger: which envs are idle; the env ids of each worker.
        recovery: the pool's failure policy (its ``worker_memory_limit``).
        batch: the pool's batch arrays (its rows, set as after the steps).
        stats: told the episodes ended.
        observation_space: the single observation space.
        action_space: the single action space.
    """

    def __init__(
        self,
        life: Lifecycle,
        episodes: Episodes,
        dispatch: Dispatch,
        ledger: Ledger,
        recovery: Recovery,
        batch: Batch,
        stats: StatsRecorder,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
    ) -> None:
        self._life = life
        self._episodes = episodes
        self._dispatch = dispatch
        self._ledger = ledger
        self._recovery = recovery
        self._batch = batch
        self._stats = stats
        self._observation_space = observation_space
        self._action_space = action_space
        self._env_name = recovery.env_name
        self._parts = RolloutParts()
        # A block of shared memory a part, given again to the same workers' parts: each keeps
        # its few mapped (shared_records.MAPPED_MOST), one free between parts.
        life.memory.keep_at_least(ledger.num_workers + 2)
        self._shipper = Shipper()

    # -- the synchronous rollout: start every env's part, wait for all ---------------------------

    def rollout(self, policy: Policy, steps: int, check_actions: bool) -> Rollout:
        """``Pool.rollout``; ``check_actions``: each action against the action space."""
        if self._parts.out:
            raise AlreadyPendingError(
                f"rollout() while parts of an asynchronous rollout are out (envs "
                f"{sorted(self._parts.pending_envs())}): rollout_wait() them first",
                name="rollout",
            )
        self.start(policy, steps, None, None, check_actions)
        return self.wait(None, None, None)

    # -- asynchronous, versioned rollouts --------------------------------------------------------

    def start(
        self,
        policy: Policy,
        steps: int,
        env_ids: Sequence[int] | np.ndarray | None,
        version: int | None,
        check_actions: bool,
        queue: bool = False,
    ) -> int:
        """``Pool.rollout_async``: one :class:`Sample` per worker of ``env_ids`` (whole
        workers' blocks) sent (``queue``: behind the part a worker has out, if any); returns
        the version that acts. Nothing is sent when a check fails."""
        self._life.check(rollouts=True)
        workers = self._workers_of(env_ids)
        ids = self._ids_of(workers)
        self._check_rollout(policy, steps, workers, ids, queue)
        version = self._shipper.prepare(policy, version)
        assignment, ship = self._ledger.assignment, self._shipper.command
        commands = [(w, ship(w, assignment[w], steps, version, check_actions)) for w in workers]
        dispatch = self._dispatch
        if self._recovery.worker_memory_limit is not None:
            dispatch.recycle_over_limit()
        # The rollout's arrays, made now: the parts may be read straight into their columns.
        spaces = self._observation_space, self._action_space
        empty = functools.partial(self._life.memory.empty, hint=tuple(workers))
        out = Out(*spaces, int(steps), ids, empty)
        parts = [Part(w, c.env_ids, int(steps), version, check_actions, out) for w, c in commands]
        for (worker, command), part in zip(commands, parts, strict=True):
            dispatch.land(worker, command, part.into)
        dispatch.submit_many(commands, True)  # the policy is bytes already
        for (_, command), part in zip(commands, parts, strict=True):
            self._parts.out[command] = part
        self._life.rolling_out = True
        return version

    def wait(self, min_envs: int | None, timeout: float | None, max_lag: int | None) -> Rollout:
        """``Pool.rollout_wait``: the parts done once at least ``min_envs`` envs' are (every
        worker's next part when ``None``), or those done after ``timeout`` seconds (at least
        one). A worker's parts go one a call, as they came in (:mod:`~envfleet.rollout_parts`);
        parts of one ``steps`` go together, those of another wait for a later call."""
        self._life.check(rollouts=True)
        parts = self._parts
        if not parts:
            raise NoPendingError(
                "rollout_wait() with no rollout pending: call rollout_async() first",
                name="rollout_wait",
            )
        owed = parts.owed()
        want = owed if min_envs is None else check_min_envs(min_envs, owed)
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout)
        dispatch = self._dispatch
        while True:
            self._take_answers()
            ready = parts.ready()
            if ready and sum(len(p.env_ids) for p in ready) >= want:
                break
            if deadline is not None and time.monotonic() >= deadline and ready:
                break  # what is done so far
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                raise TimeoutError(
                    f"rollout_wait(timeout={timeout}): no part done yet; the envs "
                    f"{sorted(parts.pending_envs())} are still out (a later rollout_wait() "
                    "returns them)"
                )
            dispatch.pump(block=True, want=1, limit=left)
        return self._hand_over(ready, check_max_lag(max_lag))

    def _take_answers(self) -> None:
        """Move the parts whose replies are in from out to in (a worker that lacked the code
        or the weights is sent them, and its part stays out)."""
        answers, out = self._ledger.answers, self._parts.out
        for command in [c for c in out if c in answers]:
            part = out.pop(command)
            reply = self._ledger.answer(command)
            got = (reply.values or {}).get(part.env_ids[0])
            if isinstance(got, Sampled) and got.in_place and reply.values is not None:
                got = reply.values[part.env_ids[0]] = part.out.placed(got, part.into)
            self._untaken(part, reply, got)
            if (
                isinstance(got, Sampled)
                and got.error is not None
                and got.error.type_name.endswith("MissingPolicy")
            ):
                # Rebuilt since: it gets the code and the newest weights, which then act.
                part.version = self._shipper.version
                again = self._shipper.command(
                    part.worker,
                    part.env_ids,
                    part.steps,
                    part.version,
                    part.check_actions,
                    force=True,
                )
                self._dispatch.land(part.worker, again, part.into)
                self._dispatch.submit_many([(part.worker, again)], True)
                out[again] = part
                continue
            part.reply = reply
            self._parts.done.append(part)

    def _untaken(self, part: Part, reply: Reply, got: Any) -> None:
        """Take back from the worker's count the env-steps its reply did not take: the ledger
        counts a :class:`Sample` answered as all its steps, but a part that stopped early (its
        policy failed, or the worker lacked it: sent again, and counted then) took fewer."""
        if reply.values is None:  # the command failed as a whole: no step recorded
            taken = 0
        elif isinstance(got, Sampled) and got.env_ids == part.env_ids:
            taken = got.steps
        else:  # no part recorded in it: nothing counted to take back
            return
        if taken < part.steps:
            self._stats.steps[part.worker] -= (part.steps - taken) * len(part.env_ids)

    def _hand_over(self, ready: list[Part], max_lag: int | None) -> Rollout:
        """The parts ``ready`` (of the first one's ``steps``) as one :class:`Rollout` over their
        envs; parts past ``max_lag`` are dropped and counted."""
        steps = ready[0].steps
        parts = [p for p in ready if p.steps == steps]
        self._parts.handed_over(parts)
        self._life.rolling_out = bool(self._parts)
        kept: list[Part] = []
        dropped_ids: list[int] = []
        for part in parts:
            lag = self._shipper.version - part.version
            dropped = max_lag is not None and lag > max_lag
            self._stats.rollout_part(lag, dropped, part.steps * len(part.env_ids))
            if dropped:
                self._assemble([part], steps)  # its envs stand where it left them
                dropped_ids.extend(part.env_ids)
            else:
                kept.append(part)
        rollout = self._assemble(kept, steps)
        if not dropped_ids:
            return rollout
        return dataclasses.replace(
            rollout, dropped_env_ids=np.array(sorted(dropped_ids), dtype=np.int64)
        )

    def _workers_of(self, env_ids: Sequence[int] | np.ndarray | None) -> list[int]:
        """The workers whose blocks make ``env_ids`` (all when ``None``), or the error."""
        ledger = self._ledger
        if env_ids is None:
            return list(range(ledger.num_workers))
        ids = check_env_ids(env_ids, ledger.num_envs)
        held = ledger.worker_of[ids]
        first = int(held[0])
        if ids.size == len(ledger.assignment[first]) and bool((held == first).all()):
            return [first]  # one worker's block (no repeats: all of it), as a Rollout's env_ids
        if (held[1:] >= held[:-1]).all():  # as a rule: blocks in order, a run per worker
            workers: list[int] = held[np.flatnonzero(np.diff(held, prepend=-1))].tolist()
        else:
            workers = np.unique(held).tolist()
        # No repeats among ids: they are those workers' whole blocks when as many.
        if sum(len(ledger.assignment[w]) for w in workers) != ids.size:
            whole = {i for w in workers for i in ledger.assignment[w]}
            raise ValueError(
                f"rollout_async(env_ids=...): a rollout runs whole workers' envs; "
                f"{sorted(whole - set(ids.tolist()))} share a worker with the envs given "
                "(pass the env_ids a Rollout returned, or whole workers' blocks)"
            )
        return workers

    def _ids_of(self, workers: list[int]) -> np.ndarray:
        """The env ids of ``workers``' blocks, in order (``int64``; from the ledger's cached
        index arrays: no Python per env)."""
        ledger = self._ledger
        blocks = [ledger.index(ledger.assignment[w]) for w in workers]
        return np.concatenate(blocks).astype(np.int64, copy=False)

    def _check_rollout(
        self, policy: Policy, steps: int, workers: list[int], ids: np.ndarray, queue: bool
    ) -> None:
        """What makes the rollout impossible, raised before anything is sent (``queue``: a
        worker may have one part outstanding, this one goes behind it)."""
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if not callable(policy):
            raise TypeError(
                f"policy must be callable (observations, env_ids) -> actions, got {policy!r}"
            )
        for what, space in (
            ("observation", self._observation_space),
            ("action", self._action_space),
        ):
            if not is_array_space(space):
                raise ValueError(
                    f"rollout() needs spaces laid out as arrays (Box, Discrete, MultiDiscrete, "
                    f"MultiBinary, Dict/Tuple of them); the {what} space is {space}: use step()"
                )
        ledger, parts = self._ledger, self._parts
        taken = set(ledger.busy(ids).tolist())
        # Parts are whole workers' blocks: an env is out when its worker's part is.
        most = QUEUED_MOST if queue else 1
        outstanding = parts.per_worker()
        for w in workers:
            others = any(type(command) is not Sample for command in ledger.pending[w])
            if others or outstanding[w] >= most:
                taken.update(ledger.assignment[w])
        if taken:
            behind = f" ({most} parts at most, queued)" if queue else ""
            raise AlreadyPendingError(
                f"rollout() needs its envs idle, but envs {sorted(taken)} have a step, a "
                f"result or a rollout pending{behind}; recv() or rollout_wait() them first",
                name="rollout",
            )
        self._episodes.check_rollout()

    def _assemble(self, done: list[Part], steps: int) -> Rollout:
        """The parts as one :class:`Rollout` over their envs; the pool's rows set as after
        the steps, or the failure raised (an env's breaks the pool, as a failed step does)."""
        failed: tuple[int, EnvFailure] | None = None
        parts: list[tuple[Part, Sampled]] = []
        for part in sorted(done, key=lambda p: p.env_ids[0]):  # in the envs' order
            reply = part.reply
            assert reply is not None
            if reply.failures and failed is None:
                failed = (part.worker, reply.failures[0])
            got = (reply.values or {}).get(part.env_ids[0])
            if isinstance(got, Sampled):
                parts.append((part, got))
        if failed is not None:
            worker, failure = failed
            self._dispatch.fail(failure.to_error(worker, self._env_name))
        obs_space, act_space = self._observation_space, self._action_space
        batch, needs_reset = self._batch, self._episodes.needs_reset
        # A worker with a part queued behind runs it now: its rows are that part's to set (in
        # shared memory, the worker's own, being written).
        later = {p.worker for p in self._parts.outstanding()}
        for part, got in parts:  # the pool's rows: where each env stands now
            if part.worker in later:
                continue
            rows = row_index(self._ledger.index(part.env_ids))
            put(obs_space, batch.observations, rows, got.final_observations)
            if got.steps:  # else its rows are as they were
                batch.rewards[rows] = got.rewards[-1]
                batch.terminations[rows] = got.terminations[-1]
                batch.truncations[rows] = got.truncations[-1]
                needs_reset[rows] = got.terminations[-1] | got.truncations[-1]
        for part, got in parts:
            if got.error is not None:  # the policy's: its envs stand where it stopped
                raise got.error.to_error(part.worker, self._env_name)
        # Each part's columns go where its envs are among all, in the envs' order. The arrays
        # made when the parts were sent are the rollout's when it is all of theirs (parts
        # read there are not copied again), else new ones.
        index = self._ledger.index
        blocks = [index(part.env_ids) for part, _ in parts]
        joined = np.concatenate(blocks) if blocks else np.zeros(0, np.intp)  # the parts' order
        in_order = not (joined[1:] < joined[:-1]).any()
        env_ids = (joined if in_order else np.sort(joined)).astype(np.int64)
        n = len(env_ids)
        made = parts[0][0].out if parts else None
        if made is None or any(p.out is not made for p, _ in parts) or len(made.env_ids) != n:
            out = Out(obs_space, act_space, steps, env_ids, self._life.memory.empty)
        else:
            out = made  # all of its envs: the same ids, in order
        for (part, got), block_ids in zip(parts, blocks, strict=True):
            where = np.searchsorted(env_ids, block_ids)
            at = int(where[0])
            block = (where == np.arange(at, at + len(where))).all()
            cols = slice(at, at + len(where)) if block else where
            out.add(got, cols, part.into if out is part.out else None)
            out.versions[:, cols] = part.version
        ended = np.zeros(self._ledger.num_envs, dtype=np.int64)
        ended[env_ids] = (out.terminations | out.truncations).sum(axis=0)
        self._stats.ended_many(ended)
        finals = [got.final_observations for _, got in parts]
        if not finals:
            final = take(obs_space, batch.observations, env_ids)
        else:  # each part's own (the batch rows may be a queued part's already)
            final = tree(obs_space, lambda *leaves: np.concatenate(leaves), *finals)
            if not in_order:
                final = take(obs_space, final, np.argsort(joined, kind="stable"))
        return out.rollout([relabelled(got, env_ids) for _, got in parts], n, final, env_ids)


__all__ = ["PoolRollouts"]
