"""The pool's rollouts: one :class:`~envfleet.protocol.Sample` per worker out, one
:class:`~envfleet.Rollout` in (:mod:`envfleet.rollouts` draws the whole flow).

The pool holds one :class:`PoolRollouts` and hands ``rollout`` to it. Before anything is sent,
it checks that a rollout can run (``steps``, the policy, spaces laid out as arrays, every env
idle and reset) and pickles the policy once for every worker; the dispatch sends the commands
and takes the replies in; the workers' parts are then assembled column block by column block,
and the pool's rows, reset flags and statistics are left as after the steps::

    rollout(policy, T) ── checks, policy pickled once ──► dispatch.replies(Sample per worker)
    Rollout ◄── _Out (T, num_envs, ...) ◄── each worker's Sampled; batch rows and
                episodes.needs_reset as after T steps; stats told the episodes ended
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.buffers import Batch, is_array_space, put, take
from envfleet.dispatch import Dispatch
from envfleet.episodes import Episodes
from envfleet.errors import AlreadyPendingError
from envfleet.infos import merge_infos
from envfleet.ledger import Ledger
from envfleet.lifecycle import Lifecycle
from envfleet.protocol import EnvFailure, Reply, Sample
from envfleet.recovery import Recovery
from envfleet.rollout_loop import Sampled, empty_steps, tree
from envfleet.rollouts import Policy, Rollout, policy_bytes
from envfleet.stats import StatsRecorder


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

    def rollout(self, policy: Policy, steps: int, check_actions: bool) -> Rollout:
        """``Pool.rollout``; ``check_actions``: each action against the action space."""
        self._life.check()
        commands = self._sample_commands(policy, steps, check_actions)
        dispatch = self._dispatch
        if self._recovery.worker_memory_limit is not None:
            dispatch.recycle_over_limit()
        replies = dispatch.replies(commands, pickles=True)  # the policy is bytes already
        return self._assemble(replies, steps)

    def _sample_commands(self, policy: Policy, steps: int, check_actions: bool) -> list[Sample]:
        """One :class:`Sample` per worker, or the error of what makes the rollout impossible."""
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
        ledger = self._ledger
        busy = ledger.busy(ledger.all_ids)
        if busy.size or any(ledger.pending):
            raise AlreadyPendingError(
                f"rollout() needs every env idle, but envs {busy.tolist()} have a step or "
                "result pending; recv() them first",
                name="rollout",
            )
        self._episodes.check_rollout()
        blob = policy_bytes(policy)  # once: every worker gets the same bytes
        return [Sample(ids, int(steps), blob, check_actions) for ids in ledger.assignment]

    def _assemble(self, replies: list[Reply], steps: int) -> Rollout:
        """The workers' parts as one :class:`Rollout`; the pool's rows set as after the steps,
        or the failure raised (an env's breaks the pool, as a failed step does)."""
        failed: tuple[int, EnvFailure] | None = None
        parts: list[tuple[int, Sampled]] = []
        assignment = self._ledger.assignment
        for worker, reply in enumerate(replies):
            if reply.failures and failed is None:
                failed = (worker, reply.failures[0])
            part = (reply.values or {}).get(assignment[worker][0])
            if isinstance(part, Sampled):
                parts.append((worker, part))
        if failed is not None:
            worker, failure = failed
            self._dispatch.fail(failure.to_error(worker, self._env_name))
        obs_space, act_space = self._observation_space, self._action_space
        batch, needs_reset = self._batch, self._episodes.needs_reset
        for _, part in parts:  # the pool's rows: where each env stands now
            rows = _columns(part.env_ids)
            put(obs_space, batch.observations, rows, part.final_observations)
            if part.steps:  # else its rows are as they were
                batch.rewards[rows] = part.rewards[-1]
                batch.terminations[rows] = part.terminations[-1]
                batch.truncations[rows] = part.truncations[-1]
                needs_reset[rows] = part.terminations[-1] | part.truncations[-1]
        for worker, part in parts:
            if part.error is not None:  # the policy's: its envs stand where it stopped
                raise part.error.to_error(worker, self._env_name)
        n = self._ledger.num_envs
        out = _Out(empty_steps(obs_space, steps, n), empty_steps(act_space, steps, n), steps, n)
        for _, part in parts:
            out.add(part, _columns(part.env_ids), obs_space, act_space)
        self._stats.ended_many((out.terminations | out.truncations).sum(axis=0))
        return out.rollout(
            [part for _, part in parts],
            n,
            take(obs_space, batch.observations, None),
        )


class _Out:
    """The rollout's arrays, filled column block by column block from the workers' parts."""

    def __init__(self, observations: Any, actions: Any, steps: int, n: int) -> None:
        self.observations = observations
        self.actions = actions
        self.rewards = np.empty((steps, n), dtype=np.float64)
        self.terminations = np.empty((steps, n), dtype=np.bool_)
        self.truncations = np.empty((steps, n), dtype=np.bool_)

    def add(
        self,
        part: Sampled,
        rows: slice | np.ndarray,
        obs_space: spaces.Space[Any],
        act_space: spaces.Space[Any],
    ) -> None:
        def fill(leaf: np.ndarray, value: np.ndarray) -> None:
            leaf[:, rows] = value

        tree(obs_space, fill, self.observations, part.observations)
        tree(act_space, fill, self.actions, part.actions)
        self.rewards[:, rows] = part.rewards
        self.terminations[:, rows] = part.terminations
        self.truncations[:, rows] = part.truncations

    def rollout(self, parts: Sequence[Sampled], n: int, final: Any) -> Rollout:
        steps = len(self.rewards)
        reset_infos = _merged([p.reset_infos for p in parts], steps, n)
        return Rollout(
            observations=self.observations,
            actions=self.actions,
            rewards=self.rewards,
            terminations=self.terminations,
            truncations=self.truncations,
            infos=_merged([p.infos for p in parts], steps, n),
            final_observations=final,
            reset_infos=reset_infos,
        )


def _merged(
    per_part: list[dict[int, dict[int, dict[str, Any]]]], steps: int, n: int
) -> list[dict[str, Any]]:
    """Each step's infos from the parts' (by step, then env), merged Gymnasium's way."""
    merged: list[dict[str, Any]] = [{} for _ in range(steps)]
    for t in sorted({t for infos in per_part for t in infos}):
        pairs: list[tuple[dict[str, Any] | None, int]] = sorted(
            ((info, i) for infos in per_part for i, info in infos.get(t, {}).items() if info),
            key=operator.itemgetter(1),
        )
        if pairs:
            merged[t] = merge_infos(pairs, n)
    return merged


def _columns(env_ids: tuple[int, ...]) -> slice | np.ndarray:
    """``env_ids`` as a slice when consecutive (views, not copies), else an index array."""
    first, last = env_ids[0], env_ids[-1]
    if last - first + 1 == len(env_ids) and list(env_ids) == list(range(first, last + 1)):
        return slice(first, last + 1)
    return np.array(env_ids, dtype=np.intp)


__all__ = ["PoolRollouts"]
