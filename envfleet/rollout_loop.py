"""The worker's side of a rollout: ``steps`` steps in a row with a policy run where the envs are.

A :class:`~envfleet.protocol.Sample` command asks a worker to do what the pool would do with
that many ``step`` calls, without a message per step::

    for t in range(steps):
        (DISABLED mode: reset the envs whose episode ended, as reset(reset_mask) would)
        actions = policy(observations of its envs, their global env ids)
        group.step(env_ids)      # the group's own step: autoreset, restarts, infos, flags
        record what the step gave

It steps through the group's own :meth:`~envfleet.group.EnvGroup.step` (or its threads'), so
autoreset modes, restarts under ``on_error="restart"``, infos and flags are exactly those of
that many steps, and after the last one the group's batch rows are what they would be (a
worker hosting one VectorEnv steps it straight into the record: ``HostedGroup.step_into``).
What it records goes back as one :class:`Sampled` per worker, in its reply's ``values``.

The policy travels cloudpickled; each worker keeps the one it unpickled while the same bytes
come again (:mod:`envfleet.worker_policies`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, create_empty_array, iterate

from envfleet.batch_rows import BlockRows, row_index
from envfleet.buffers import put, take
from envfleet.errors import Phase
from envfleet.guards import env_errors
from envfleet.hosted.group import HostedGroup
from envfleet.info_columns import BatchedInfos
from envfleet.protocol import EnvFailure, Group, Reply, Sample
from envfleet.recycling import Recycler
from envfleet.shared_records import recorded_views
from envfleet.validation import check_actions, keeps_dtype
from envfleet.worker_policies import MissingPolicy, WeightsFailed, policy_failure, policy_of

_FLAT_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)

_RECORDS: weakref.WeakKeyDictionary[Any, Recycler] = weakref.WeakKeyDictionary()
"""Per group, the memory of its recorded arrays (sent and dropped each rollout), used again by
its next rollout; gone with the group."""


@dataclass
class Sampled:
    """One worker's part of a rollout: arrays shaped ``(steps, len(env_ids), ...)``.

    ``steps`` is how many steps were recorded: all those asked for, unless the policy failed
    (``error``) or an env did (the reply's ``failures``).
    """

    env_ids: tuple[int, ...]
    steps: int
    observations: Any
    actions: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: dict[int, Mapping[int, dict[str, Any]]]
    """The non-empty infos by step, then by env (steps where no env had any: absent)."""
    reset_infos: dict[int, Mapping[int, dict[str, Any]]]
    """DISABLED mode: the infos of the envs reset before each step, by step, then by env."""
    final_observations: Any
    """The envs' observations after the last step (their rewards and flags: the last step's)."""
    error: EnvFailure | None = None
    """The policy's failure that stopped the rollout (its envs stand where it stopped)."""
    version: int = 0
    """The version of the policy's weights that chose every action of this part."""
    in_place: bool = False
    """Its recorded arrays are where the command's ``record`` named (the pool's own): they do
    not travel, and the fields that hold them here are empty."""


def tree(space: spaces.Space[Any], fn: Callable[..., Any], *nests: Any) -> Any:
    """``fn`` applied to the leaves of ``nests`` laid out like ``space`` (Dict/Tuple)."""
    if isinstance(space, spaces.Dict):
        return {key: tree(sub, fn, *(n[key] for n in nests)) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(tree(sub, fn, *(n[k] for n in nests)) for k, sub in enumerate(space.spaces))
    return fn(*nests)


ALIGN = 64
"""Where each field of a record's block starts: a multiple of this many bytes."""


def record_arrays(
    obs_space: spaces.Space[Any],
    act_space: spaces.Space[Any],
    steps: int,
    count: int,
    rewards: Any,
    empty: Callable[..., np.ndarray] = np.empty,
) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
    """What a part of ``count`` envs records over ``steps`` steps (observations, actions laid
    out like their spaces; rewards of dtype ``rewards``; terminations, truncations), each
    ``(steps, count, ...)``, in one block that ``empty`` makes (a pool's shared memory: a
    worker may record there, :mod:`envfleet.shared_records`)."""
    fields, cuts = record_fields(obs_space, act_space, rewards)
    sizes = [steps * count * math.prod(shape) * kind.itemsize for shape, kind in fields]
    starts = [0]
    for size in sizes[:-1]:
        starts.append(-(-(starts[-1] + size) // ALIGN) * ALIGN)
    block = empty(starts[-1] + sizes[-1], np.uint8)
    arrays = [
        block[at : at + size].view(kind).reshape(steps, count, *shape)
        for at, size, (shape, kind) in zip(starts, sizes, fields, strict=True)
    ]
    return _laid_out(obs_space, act_space, arrays, cuts)


def record_fields(
    obs_space: spaces.Space[Any], act_space: spaces.Space[Any], rewards: Any
) -> tuple[list[tuple[tuple[int, ...], np.dtype[Any]]], tuple[int, int]]:
    """Each array a part records, in order (the observations' leaves, the actions', rewards of
    dtype ``rewards``, terminations, truncations), as its shape past ``(steps, count)`` and its
    dtype; and where the observations' leaves end and the actions' do."""
    obs, act = _leaf_fields(obs_space), _leaf_fields(act_space)
    fields = [*obs, *act]
    flag = ((), np.dtype(np.bool_))
    return [*fields, ((), np.dtype(rewards)), flag, flag], (len(obs), len(fields))


def _leaf_fields(space: spaces.Space[Any]) -> list[tuple[tuple[int, ...], np.dtype[Any]]]:
    """The shape and dtype of each leaf of ``space``'s batches (a flat space's own)."""
    if isinstance(space, _FLAT_SPACES) and space.shape is not None:  # without making one
        return [(tuple(space.shape), np.dtype(space.dtype))]
    return [(a.shape[1:], a.dtype) for a in leaves(space, create_empty_array(space, 1))]


def _laid_out(
    obs_space: spaces.Space[Any],
    act_space: spaces.Space[Any],
    arrays: list[np.ndarray],
    cuts: tuple[int, int],
) -> tuple[Any, Any, np.ndarray, np.ndarray, np.ndarray]:
    """A record's ``arrays`` (as :func:`record_fields` orders them, ``cuts`` its) as its five
    fields."""
    split, k = cuts
    observations, actions = nested(obs_space, arrays[:split]), nested(act_space, arrays[split:k])
    return observations, actions, arrays[k], arrays[k + 1], arrays[k + 2]


def placed(
    part: Sampled, into: Sampled, obs_space: spaces.Space[Any], act_space: spaces.Space[Any]
) -> Sampled:
    """``part``, recorded in place (``in_place``: where ``into``'s arrays are), holding them:
    ``into``'s very arrays when it took all their steps, their first rows else."""
    steps = part.steps

    def cut(leaf: np.ndarray) -> np.ndarray:
        return leaf if steps == len(leaf) else leaf[:steps]

    return dataclasses.replace(
        part,
        observations=tree(obs_space, cut, into.observations),
        actions=tree(act_space, cut, into.actions),
        rewards=cut(into.rewards),
        terminations=cut(into.terminations),
        truncations=cut(into.truncations),
        in_place=False,
    )


def sample(group: Group, command: Sample) -> Reply:
    """Serve ``command``: its steps with its policy, recorded (see the module docstring)."""
    ids = command.env_ids
    index = np.array(ids, dtype=np.intp)
    batch = group.batch
    obs_space, act_space = group.observation_space, group.action_space
    steps, count = command.steps, len(ids)
    record = _in_place(command, obs_space, act_space, batch.rewards.dtype)
    if record is None:
        memory = _RECORDS.get(group)
        if memory is None:
            memory = _RECORDS[group] = Recycler(keep=1)
        fields = record_arrays(
            obs_space, act_space, steps, count, batch.rewards.dtype, memory.empty
        )
        record = Sampled(ids, 0, *fields, infos={}, reset_infos={}, final_observations=None)
    failures: tuple[EnvFailure, ...] = ()
    restarts: list[EnvFailure] = []
    try:
        policy = policy_of(group, command)
    except MissingPolicy as exc:  # the pool sends the code or the weights, and asks again
        record.error = EnvFailure.capture(None, Phase.STEP, exc)
        policy = None
    except WeightsFailed as exc:
        record.error = policy_failure(
            exc.__cause__ or exc, f"could not load the weights of version {command.version}"
        )
        policy = None
    except env_errors() as exc:
        record.error = policy_failure(exc, "could not be unpickled on the worker")
        policy = None
    record.version = command.version
    disabled = group.mode is AutoresetMode.DISABLED
    flat = isinstance(act_space, _FLAT_SPACES) and isinstance(batch.actions, np.ndarray)
    rows = row_index(index)
    shape = (count, *(act_space.shape or ())) if flat else None
    actions_rows = batch.actions[rows] if flat and isinstance(rows, slice) else None
    obs_rows = None  # one array each side: the observations go straight into the record
    if isinstance(batch.observations, np.ndarray) and isinstance(record.observations, np.ndarray):
        obs_rows = BlockRows(batch.observations, rows)
    rewards, terminations = BlockRows(batch.rewards, rows), BlockRows(batch.terminations, rows)
    truncations = BlockRows(batch.truncations, rows)
    flag_rows = (rewards, terminations, truncations)
    # A hosted VectorEnv steps straight into the record (HostedGroup.step_into), its batch rows
    # brought up to date when a step goes through the group's own step, and at the end.
    hosted = group if isinstance(group, HostedGroup) and actions_rows is not None else None
    ahead = False  # the record holds steps the batch rows do not
    for t in range(steps):
        if policy is None:
            break
        if disabled:
            ended = index[batch.terminations[index] | batch.truncations[index]]
            if ended.size:
                reply = group.reset(tuple(ended.tolist()), [None] * ended.size, None)
                restarts += reply.restarts
                if reply.failures:
                    failures = reply.failures
                    break
                if reply.infos:
                    record.reset_infos[t] = _as_arrays(reply.infos)
        if obs_rows is not None:  # straight into the record: the policy sees that row as is
            observations = record.observations[t]
            if not ahead:
                obs_rows.into(observations)
        else:
            observations = take(obs_space, batch.observations, index)
        try:
            actions = policy(observations, index.copy())
            if type(actions) is not np.ndarray or actions.shape != shape:  # else: as checked
                actions = check_actions(act_space, actions, index, check_membership=False)
            if command.check_actions:
                check_actions(act_space, actions, index, check_membership=True)
        except env_errors() as exc:
            record.error = policy_failure(exc, f"failed at step {t} of {steps}")
            break
        if (
            hosted is not None
            and obs_rows is not None
            and actions.dtype == batch.actions.dtype
            and hosted.plain(ids)
        ):
            last = record.observations[t + 1] if t + 1 < steps else obs_rows.view
            into = (last, record.rewards[t], record.terminations[t], record.truncations[t])
            reply = hosted.step_into(ids, actions, observations, into) or _PLAIN
            ahead = True
        else:
            if ahead:
                _catch_up(record, steps, obs_rows, flag_rows)
                ahead = False
            carried: dict[int, Any] | None = None
            if flat and actions.dtype == batch.actions.dtype:
                if actions_rows is not None:
                    actions_rows[...] = actions
                else:
                    batch.actions[index] = actions
            elif not flat and keeps_dtype(act_space, actions):
                put(act_space, batch.actions, index, actions)
            else:  # another dtype: the envs get the actions as the policy gave them
                batched = batch_space(act_space, count)
                items = list(actions) if flat else list(iterate(batched, actions))
                carried = dict(zip(ids, items, strict=True))
            reply = group.step(ids, carried)
        restarts += reply.restarts
        if reply.failures:
            failures = reply.failures
            break
        if not ahead:  # the group's step wrote the batch rows: into the record
            if obs_rows is None:
                _set_step(obs_space, record.observations, t, observations)
            rewards.into(record.rewards[t])
            terminations.into(record.terminations[t])
            truncations.into(record.truncations[t])
        if flat:
            record.actions[t] = actions
        else:
            _set_step(act_space, record.actions, t, actions)
        if reply.infos:
            record.infos[t] = _as_arrays(reply.infos)
        record.steps = t + 1
    if ahead:
        _catch_up(record, steps, obs_rows, flag_rows)
    done = record.steps
    if record.in_place:  # the pool has them: none travels
        record.observations = record.actions = None
        record.rewards = record.terminations = record.truncations = _NOTHING
    elif done < steps:  # stopped early: only what was recorded travels
        for name in ("observations", "actions"):
            space = obs_space if name == "observations" else act_space
            setattr(record, name, tree(space, lambda a: a[:done], getattr(record, name)))
        record.rewards = record.rewards[:done]
        record.terminations = record.terminations[:done]
        record.truncations = record.truncations[:done]
    record.final_observations = take(obs_space, batch.observations, index)
    return Reply(values={ids[0]: record}, failures=failures, restarts=tuple(restarts))


def _catch_up(record: Sampled, steps: int, obs_rows: Any, flag_rows: tuple[BlockRows, ...]) -> None:
    """The batch rows as the group's own steps would have left them after the record's last
    step (its observations after it, in the record's next row unless it was the last)."""
    done = record.steps
    if done < steps:
        obs_rows.view[...] = record.observations[done]
    if done:
        columns = (record.rewards, record.terminations, record.truncations)
        for rows, column in zip(flag_rows, columns, strict=True):
            rows.view[...] = column[done - 1]


_PLAIN = Reply()
"""A plain step's reply (nothing to report), read only."""

_NOTHING = np.zeros(0)
"""What an in-place part's recorded fields hold in its reply."""


def leaves(space: spaces.Space[Any], nest: Any) -> list[np.ndarray]:
    """The arrays of ``nest`` laid out like ``space``, in :func:`tree`'s order."""
    found: list[np.ndarray] = []
    tree(space, found.append, nest)
    return found


def nested(space: spaces.Space[Any], arrays: list[np.ndarray]) -> Any:
    """``arrays`` (as :func:`leaves` gives them) laid out like ``space`` again."""
    if not isinstance(space, spaces.Dict | spaces.Tuple):
        return arrays[0]
    it = iter(arrays)
    return tree(space, lambda _: next(it), create_empty_array(space, 1))


def _in_place(
    command: Sample, obs_space: spaces.Space[Any], act_space: spaces.Space[Any], rewards: Any
) -> Sampled | None:
    """A record whose arrays are the columns ``command.record`` names, where the block maps and
    each array is as this worker would record it; else ``None`` (its own, sent)."""
    ref = command.record
    if ref is None:
        return None
    try:
        views = recorded_views(ref)
    except OSError:
        return None
    steps = (command.steps, len(command.env_ids))
    fields, cuts = record_fields(obs_space, act_space, rewards)
    if len(views) != len(fields) or any(
        v.shape != steps + shape or v.dtype != kind
        for v, (shape, kind) in zip(views, fields, strict=True)
    ):
        return None
    laid_out = _laid_out(obs_space, act_space, views, cuts)
    return Sampled(command.env_ids, 0, *laid_out, {}, {}, None, in_place=True)


def _as_arrays(infos: Mapping[int, dict[str, Any]]) -> Mapping[int, dict[str, Any]]:
    """A step's envs' infos, as arrays where every env's are alike (the pool stacks them,
    with no dict per env: :class:`~envfleet.info_columns.BatchedInfos`)."""
    if isinstance(infos, BatchedInfos):
        return infos
    return BatchedInfos.of_dicts(infos) or infos


def _set_step(space: spaces.Space[Any], record: Any, t: int, value: Any) -> None:
    """Row ``t`` of ``record`` (``(steps, count, ...)`` leaves) set to the batch ``value``."""

    def set_leaf(leaf: np.ndarray, part: Any) -> None:
        leaf[t] = part

    tree(space, set_leaf, record, value)


__all__ = [
    "ALIGN",
    "Sampled",
    "leaves",
    "nested",
    "placed",
    "record_arrays",
    "record_fields",
    "sample",
    "tree",
]
