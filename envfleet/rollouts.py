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

This module holds what a caller meets (:class:`Policy`, :class:`RandomPolicy`, :class:`Rollout`);
the pool's side, which builds the commands and assembles the replies, is the collaborator the
pool holds for its rollouts (:class:`envfleet.pool_rollouts.PoolRollouts`).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import cloudpickle
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet.info_columns import BatchedInfos
from envfleet.infos import merge_infos
from envfleet.rollout_loop import Sampled, placed, record_arrays, tree


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


def policy_bytes(policy: Policy) -> bytes:
    """``policy`` pickled as cloudpickle would: by pickle's C pickler when that refers to no
    ``__main__`` name (cloudpickle's, in Python, costs the driver twice as much, once per
    rollout), else (a lambda, a closure, anything of ``__main__``, which a worker elsewhere
    cannot import) by cloudpickle, by value. What a rollout sends the workers."""
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
    env_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The envs of the columns, in order: every env for :meth:`~envfleet.Pool.rollout`; those
    whose parts were done for :meth:`~envfleet.Pool.rollout_wait`."""
    policy_versions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    """The version of the policy's weights that chose each action, ``int64``
    ``(steps, len(env_ids))``: the caller's ``version=``, or counted by the pool (one more
    each time the policy's weights differ from the last sent)."""
    dropped_env_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The envs whose parts this :meth:`~envfleet.Pool.rollout_wait` dropped, acting more than
    ``max_lag`` versions behind (counted in ``stats()``, not in the columns): to be started
    anew with the envs of ``env_ids``, as they are (``queue=True`` where their worker has a part
    queued behind the dropped one: the next goes behind it)."""

    @property
    def steps(self) -> int:
        """Vector steps recorded."""
        return len(self.rewards)


class Out:
    """A rollout's arrays over ``env_ids`` (in order), made when its parts are sent: a transport
    that can reads each part straight into its columns (:meth:`into`), the pool copies the
    others' in (:meth:`add`); one copy of each field either way."""

    def __init__(
        self,
        obs_space: spaces.Space[Any],
        act_space: spaces.Space[Any],
        steps: int,
        env_ids: np.ndarray,
        empty: Callable[..., np.ndarray] = np.empty,
    ) -> None:
        n = len(env_ids)
        self.env_ids = env_ids
        # Every recorded field in one block of ``empty``'s (shared memory, where the pool's is:
        # a process worker may record its part there, :mod:`envfleet.shared_records`).
        fields = record_arrays(obs_space, act_space, steps, n, np.float64, empty)
        self.observations, self.actions, self.rewards, self.terminations, self.truncations = fields
        self.versions = np.empty((steps, n), dtype=np.int64)  # each part's, once they are in
        self._spaces = (obs_space, act_space)

    def into(self, env_ids: tuple[int, ...]) -> Sampled:
        """A part over ``env_ids`` (consecutive columns here) whose arrays are views of their
        columns: where a transport may read the recorded arrays of that part."""
        at = int(np.searchsorted(self.env_ids, env_ids[0]))
        cols = slice(at, at + len(env_ids))
        obs_space, act_space = self._spaces

        def view(leaf: np.ndarray) -> np.ndarray:
            return leaf[:, cols]

        return Sampled(
            env_ids=env_ids,
            steps=len(self.rewards),
            observations=tree(obs_space, view, self.observations),
            actions=tree(act_space, view, self.actions),
            rewards=self.rewards[:, cols],
            terminations=self.terminations[:, cols],
            truncations=self.truncations[:, cols],
            infos={},
            reset_infos={},
            final_observations=None,
        )

    def placed(self, part: Sampled, into: Sampled) -> Sampled:
        """``part`` recorded in place, holding ``into``'s arrays (:func:`placed`)."""
        return placed(part, into, *self._spaces)

    def add(self, part: Sampled, rows: slice | np.ndarray, into: Sampled | None = None) -> None:
        """``part``'s arrays into columns ``rows``, unless they are ``into``'s very arrays
        (the transport read them there: :meth:`into`)."""
        obs_space, act_space = self._spaces
        read = part if into is None else into  # a field read in place: ``into``'s own array

        def fill(leaf: np.ndarray, value: np.ndarray, in_place: np.ndarray) -> None:
            if into is None or value is not in_place:
                leaf[:, rows] = value

        tree(obs_space, fill, self.observations, part.observations, read.observations)
        tree(act_space, fill, self.actions, part.actions, read.actions)
        fill(self.rewards, part.rewards, read.rewards)
        fill(self.terminations, part.terminations, read.terminations)
        fill(self.truncations, part.truncations, read.truncations)

    def rollout(self, parts: Sequence[Sampled], n: int, final: Any, env_ids: np.ndarray) -> Rollout:
        """The :class:`Rollout` of these arrays. Its observations are the block's own; the
        other fields are copies (small beside them), so that a caller who keeps only those
        (rewards, say) does not keep the block's memory from the rollouts to come."""
        steps = len(self.rewards)
        reset_infos = merged([p.reset_infos for p in parts], steps, n)
        return Rollout(
            observations=self.observations,
            actions=tree(self._spaces[1], np.copy, self.actions),
            rewards=self.rewards.copy(),
            terminations=self.terminations.copy(),
            truncations=self.truncations.copy(),
            infos=merged([p.infos for p in parts], steps, n),
            final_observations=final,
            reset_infos=reset_infos,
            env_ids=env_ids,
            policy_versions=self.versions,
        )


def merged(
    per_part: list[dict[int, Mapping[int, dict[str, Any]]]], steps: int, n: int
) -> list[dict[str, Any]]:
    """Each step's infos from the parts' (by step, then env), merged Gymnasium's way."""
    merged: list[dict[str, Any]] = [{} for _ in range(steps)]
    for t in sorted({t for infos in per_part for t in infos}):
        arrays = [infos[t] for infos in per_part if t in infos]
        if all(isinstance(a, BatchedInfos) for a in arrays):  # each part's kept as arrays
            batched = sorted(cast(list[BatchedInfos], arrays), key=lambda a: a.env_ids[0])
            joined = BatchedInfos.join(batched)
            stacked = joined.stacked(n) if joined is not None else None
            if stacked is not None:
                merged[t] = stacked
                continue
        pairs: list[tuple[dict[str, Any] | None, int]] = sorted(
            ((info, i) for infos in per_part for i, info in infos.get(t, {}).items() if info),
            key=operator.itemgetter(1),
        )
        if pairs:
            merged[t] = merge_infos(pairs, n)
    return merged


def relabelled(part: Sampled, env_ids: np.ndarray) -> Sampled:
    """``part`` with its infos under their columns in the rollout (positions in ``env_ids``,
    sorted, not env ids); ``part`` itself when it has none."""
    if not part.infos and not part.reset_infos:
        return part

    def moved(
        infos: dict[int, Mapping[int, dict[str, Any]]],
    ) -> dict[int, Mapping[int, dict[str, Any]]]:
        out: dict[int, Mapping[int, dict[str, Any]]] = {}
        places: dict[tuple[int, ...], tuple[int, ...]] = {}  # by a step's env ids: columns
        for t, by_env in infos.items():
            if isinstance(by_env, BatchedInfos):  # its arrays as they are, under their columns
                at = places.get(by_env.env_ids)
                if at is None:
                    found = np.searchsorted(env_ids, np.array(by_env.env_ids, np.int64))
                    at = places[by_env.env_ids] = tuple(found.tolist())
                out[t] = by_env.relabelled(at)
                continue
            found = np.searchsorted(env_ids, np.fromiter(by_env, np.int64, len(by_env)))
            out[t] = dict(zip(found.tolist(), by_env.values(), strict=True))
        return out

    return dataclasses.replace(part, infos=moved(part.infos), reset_infos=moved(part.reset_infos))


__all__ = ["Out", "Policy", "RandomPolicy", "Rollout", "relabelled"]
