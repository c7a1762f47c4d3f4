"""Rollouts: many steps per message, with a policy that runs where the envs are.

:meth:`Pool.rollout <envfleet.Pool.rollout>` sends each worker one
:class:`~envfleet.protocol.Sample` command; the worker steps its envs ``steps`` times, asking
the policy for each step's actions (:mod:`envfleet.rollout_loop`), and sends back what it
recorded in one reply. The pool gets ``steps`` vector steps for one message per worker (per
node, on a cluster), instead of one per step::

    pool.rollout(policy, T) ──► Sample(env ids, T, pickled policy) per worker (one per node
                                message on a cluster)
    worker: T x (actions = policy(its observations, its env ids); its group's step; record)
    Rollout ◄── arrays (T, num_envs, ...) assembled from the workers' parts; the pool's rows,
                ledger and statistics left as after T steps

The trajectories are those of ``T`` calls of ``pool.step`` with the policy's actions: same
autoreset, restarts, infos and flags; a policy whose actions depend only on each env's
observations and id (:class:`RandomPolicy`: one generator per env) gives the same arrays
whatever the backend and the layout of workers and nodes.
"""

from __future__ import annotations

import copy
import operator
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet.buffers import is_array_space, put, take
from envfleet.errors import AlreadyPendingError, ResetNeededError
from envfleet.infos import merge_infos
from envfleet.protocol import EnvFailure, Reply, Sample
from envfleet.rollout_loop import Sampled, empty_steps, tree

if TYPE_CHECKING:
    from envfleet.buffers import Batch
    from envfleet.dispatch import Dispatch
    from envfleet.ledger import Ledger
    from envfleet.recovery import Recovery
    from envfleet.stats import StatsRecorder


class Policy(Protocol):
    """What :meth:`~envfleet.Pool.rollout` runs on each worker: the actions of its envs.

    Called with a batch of observations (rows of the observation space, one per env, as
    ``pool.step`` returns them) and the global indices of those envs (an int array); returns
    one action per env, as ``pool.step`` takes them. It travels to the workers cloudpickled.
    """

    def __call__(self, observations: Any, env_ids: np.ndarray) -> Any: ...


class RandomPolicy:
    """Random actions, one generator per env: env ``i`` draws from ``action_space`` seeded
    with ``seed + i``, so its actions do not depend on which worker or node steps it.

    Args:
        action_space: the single action space of the pool (``pool.single_action_space``).
        seed: the base seed (``None``: unseeded).

    Examples:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> from envfleet import RandomPolicy
        >>> policy = RandomPolicy(spaces.Discrete(3), seed=0)
        >>> a = policy(None, np.array([0, 1, 2]))  # one action per env, env i seeded 0 + i
        >>> again = RandomPolicy(spaces.Discrete(3), seed=0)(None, np.array([0, 1, 2]))
        >>> bool((a == again).all())
        True
    """

    def __init__(self, action_space: spaces.Space[Any], seed: int | None = None) -> None:
        self.action_space = copy.deepcopy(action_space)
        # A template, never drawn from: without a generator (Gymnasium makes one when first
        # used), the policy pickles in half the time, once per rollout.
        self.action_space._np_random = None  # type: ignore[assignment]  # its initial state
        self.seed = seed
        self._per_env: dict[int, spaces.Space[Any]] = {}
        self._bytes: bytes | None = None  # pickled, while not called since

    def __call__(self, observations: Any, env_ids: np.ndarray) -> Any:
        self._bytes = None
        space = self.action_space
        if type(space) is spaces.Discrete:  # Discrete.sample's own draw, without its checks
            n, kind = space.n, space.dtype.type
            each = (self._space(int(i)).np_random.integers(n, dtype=kind) for i in env_ids)
            out = np.fromiter(each, dtype=space.dtype, count=len(env_ids))
            out += space.start
            return out
        draws = [self._space(int(i)).sample() for i in env_ids]
        batch: Any = create_empty_array(space, len(draws), fn=np.zeros)
        return concatenate(space, draws, batch)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_bytes":  # another seed or space: pickled anew
            object.__setattr__(self, "_bytes", None)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bytes": None}

    def _pickled(self) -> bytes:
        """This policy pickled, kept from one rollout to the next while it is not called here
        (its generators advance in the workers' copies, not in this one)."""
        blob = self.__dict__.get("_bytes")
        if blob is None:
            blob = self._bytes = pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        return blob

    def _space(self, i: int) -> spaces.Space[Any]:
        space = self._per_env.get(i)
        if space is None:
            space = self._per_env[i] = copy.deepcopy(self.action_space)
            space.seed(None if self.seed is None else self.seed + i)
        return space

    def __repr__(self) -> str:
        return f"RandomPolicy({self.action_space}, seed={self.seed})"


@dataclass(frozen=True)
class Rollout:
    """What :meth:`~envfleet.Pool.rollout` returns: ``steps`` vector steps of every env.

    Arrays are shaped ``(steps, num_envs, ...)`` with the spaces' dtypes (a Dict or Tuple
    space gives a dict or tuple of them); ``[t]`` is what the ``t``-th of as many
    ``pool.step(actions)`` calls took and returned.

    Examples:
        >>> import envfleet
        >>> with envfleet.make("CartPole-v1", 2, backend="serial", seed=0) as pool:
        ...     _ = pool.reset()
        ...     out = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 10)
        >>> out.steps, out.rewards.shape, out.rewards.dtype, out.terminations.dtype
        (10, (10, 2), dtype('float64'), dtype('bool'))
    """

    observations: Any
    """What the policy saw at each step: the observations before it."""
    actions: Any
    """The policy's actions (stored in the action space's dtype)."""
    rewards: np.ndarray
    """The rewards, ``float64`` ``(steps, num_envs)``, as ``pool.step`` returns them."""
    terminations: np.ndarray
    """Whether each env's episode ended at that step (a terminal state), ``bool``
    ``(steps, num_envs)``."""
    truncations: np.ndarray
    """Whether each env's episode was cut at that step (a time limit, or a restart under
    ``on_error="restart"``), ``bool`` ``(steps, num_envs)``."""
    infos: list[dict[str, Any]]
    """Each step's infos, merged Gymnasium's way (``_key`` masks)."""
    final_observations: Any
    """The observations after the last step (what the next step or rollout starts from)."""
    reset_infos: list[dict[str, Any]]
    """Autoreset mode ``DISABLED`` only (else empty dicts): a rollout resets the envs whose
    episode ended before their next step, as ``reset(options={"reset_mask": ...})`` would;
    each step's entry holds the infos of the envs reset before it (their observations are
    those in ``observations[t]``)."""

    @property
    def steps(self) -> int:
        """Vector steps recorded."""
        return len(self.rewards)


class PoolRollouts:
    """:meth:`rollout`, the pool's rollouts (a mixin: the pool gives it its parts)."""

    if TYPE_CHECKING:  # what the pool provides
        num_envs: int
        check_actions: bool
        autoreset_mode: AutoresetMode
        single_observation_space: spaces.Space[Any]
        single_action_space: spaces.Space[Any]
        _env_name: str
        _all_ids: np.ndarray
        _assignment: list[tuple[int, ...]]
        _batch: Batch
        _dispatch: Dispatch
        _ledger: Ledger
        _recovery: Recovery
        _stats: StatsRecorder
        _needs_reset: np.ndarray
        _never_reset: np.ndarray

        def _check_usable(self) -> None: ...
        def _gather(self, env_ids: np.ndarray) -> tuple[Any, ...]: ...

    def rollout(self, policy: Policy, steps: int) -> Rollout:
        """Step every env ``steps`` times with ``policy``'s actions, the policy running on the
        workers: one message per worker (per node, on a cluster) for the whole rollout.

        The same as ``steps`` calls of ``pool.step(policy(obs, np.arange(num_envs)))`` (with
        a policy that decides per env): autoreset, restarts, infos and flags; afterwards the
        pool stands where those steps would leave it, and ``step`` or another rollout goes
        on from there. Each worker keeps its copy of the policy while the same policy (the
        same pickled bytes) comes again: a stateful policy continues where it was.

        Args:
            policy: ``policy(observations, env_ids) -> actions`` (:class:`Policy`); it must
                pickle with cloudpickle.
            steps: vector steps, at least 1.

        Returns:
            Rollout: the observations, actions, rewards, flags and infos of every step, as
                arrays shaped ``(steps, num_envs, ...)``.

        Raises:
            ValueError, TypeError: ``steps`` or ``policy`` is not usable, or a space is not
                laid out as arrays (checked before anything is sent: the pool stays usable).
            AlreadyPendingError: an env has a step or result pending (async mode).
            ResetNeededError: an env was never reset.
            EnvError: an env failed, as ``step`` would raise it (``on_error="raise"``: the
                pool is broken, as after a failed step); or the policy failed on a worker
                (its envs stand where it stopped; the pool stays usable).

        Examples:
            >>> import envfleet
            >>> with envfleet.make("CartPole-v1", 4, num_workers=2, backend="thread") as pool:
            ...     _ = pool.reset(seed=0)
            ...     out = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 0), 50)
            >>> out.observations.shape, out.actions.dtype, out.rewards.shape
            ((50, 4, 4), dtype('int64'), (50, 4))
        """
        self._check_usable()
        commands = self._sample_commands(policy, steps)
        dispatch = self._dispatch
        if self._recovery.worker_memory_limit is not None:
            dispatch.recycle_over_limit()
        replies = dispatch.replies(commands, pickles=True)  # the policy is bytes already
        return self._assemble(replies, steps)

    def _sample_commands(self, policy: Policy, steps: int) -> list[Sample]:
        """One :class:`Sample` per worker, or the error of what makes the rollout impossible."""
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if not callable(policy):
            raise TypeError(
                f"policy must be callable (observations, env_ids) -> actions, got {policy!r}"
            )
        for what, space in (
            ("observation", self.single_observation_space),
            ("action", self.single_action_space),
        ):
            if not is_array_space(space):
                raise ValueError(
                    f"rollout() needs spaces laid out as arrays (Box, Discrete, MultiDiscrete, "
                    f"MultiBinary, Dict/Tuple of them); the {what} space is {space}: use step()"
                )
        busy = self._ledger.busy(self._all_ids)
        if busy.size or any(self._ledger.pending):
            raise AlreadyPendingError(
                f"rollout() needs every env idle, but envs {busy.tolist()} have a step or "
                "result pending; recv() them first",
                name="rollout",
            )
        if self._never_reset.any():
            raise ResetNeededError(
                f"envs {np.flatnonzero(self._never_reset).tolist()} have not been reset yet: "
                "call reset() before rollout(); nothing was sent"
            )
        blob = _pickled(policy)  # once: every worker gets the same bytes
        return [Sample(ids, int(steps), blob, self.check_actions) for ids in self._assignment]

    def _assemble(self, replies: list[Reply], steps: int) -> Rollout:
        """The workers' parts as one :class:`Rollout`; the pool's rows set as after the steps,
        or the failure raised (an env's breaks the pool, as a failed step does)."""
        failed: tuple[int, EnvFailure] | None = None
        parts: list[tuple[int, Sampled]] = []
        for worker, reply in enumerate(replies):
            if reply.failures and failed is None:
                failed = (worker, reply.failures[0])
            part = (reply.values or {}).get(self._assignment[worker][0])
            if isinstance(part, Sampled):
                parts.append((worker, part))
        if failed is not None:
            worker, failure = failed
            self._dispatch.fail(failure.to_error(worker, self._env_name))
        obs_space, act_space = self.single_observation_space, self.single_action_space
        batch = self._batch
        for _, part in parts:  # the pool's rows: where each env stands now
            rows = _columns(part.env_ids)
            put(obs_space, batch.observations, rows, part.final_observations)
            if part.steps:  # else its rows are as they were
                batch.rewards[rows] = part.rewards[-1]
                batch.terminations[rows] = part.terminations[-1]
                batch.truncations[rows] = part.truncations[-1]
                self._needs_reset[rows] = part.terminations[-1] | part.truncations[-1]
        for worker, part in parts:
            if part.error is not None:  # the policy's: its envs stand where it stopped
                raise part.error.to_error(worker, self._env_name)
        n = self.num_envs
        out = _Out(empty_steps(obs_space, steps, n), empty_steps(act_space, steps, n), steps, n)
        for _, part in parts:
            out.add(part, _columns(part.env_ids), obs_space, act_space)
        self._stats.ended_many((out.terminations | out.truncations).sum(axis=0))
        return out.rollout(
            [part for _, part in parts],
            n,
            take(obs_space, batch.observations, None),
        )


def _pickled(policy: Policy) -> bytes:
    """``policy`` pickled as cloudpickle would: by pickle's C pickler when that refers to no
    ``__main__`` name (cloudpickle's, in Python, costs the driver twice as much, once per
    rollout), else (a lambda, a closure, anything of ``__main__``, which a worker elsewhere
    cannot import) by cloudpickle, by value."""
    if type(policy) is RandomPolicy:
        return policy._pickled()
    try:
        blob = pickle.dumps(policy, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in blob:
            return blob
    except Exception:
        pass
    try:
        data: bytes = cloudpickle.dumps(policy, protocol=pickle.HIGHEST_PROTOCOL)
        return data
    except Exception as exc:
        raise TypeError(
            f"the policy must pickle (with cloudpickle) to reach the workers: {exc}"
        ) from exc


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
