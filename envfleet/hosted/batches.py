"""A hosted VectorEnv's batches seen env by env: its infos per env, rows of its
observations, its rows of the pool's batch, the leaves of a space, how it is called (and its
attributes set) and whether it has ``send``/``recv``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import VectorEnv

from envfleet.buffers import Batch, is_array_space, view_rows
from envfleet.errors import Phase
from envfleet.guards import env_errors
from envfleet.info_columns import BatchedInfos, unmasked_arrays
from envfleet.protocol import EnvFailure, Reply


def sends(venv: Any) -> bool:
    """Whether ``venv`` steps through ``send``/``recv`` of all its envs at once (a
    ``batch_size``, where it has one, of all its envs: a smaller one answers part of them)."""
    return (
        callable(getattr(venv, "send", None))
        and callable(getattr(venv, "recv", None))
        and getattr(venv, "batch_size", venv.num_envs) == venv.num_envs
    )


def block_views(batch: Batch, action_space: spaces.Space[Any], rows: slice) -> tuple[Any, ...]:
    """A block's rows of the pool's batch, made once for every step (the batch arrays never
    move): its actions (``None`` unless they batch into arrays), its observations (``None``
    unless one array), rewards, terminations and truncations."""
    actions = None
    if is_array_space(action_space):
        actions = view_rows(action_space, batch.actions, rows.start, rows.stop)
    obs = batch.observations[rows] if type(batch.observations) is np.ndarray else None
    return actions, obs, batch.rewards[rows], batch.terminations[rows], batch.truncations[rows]


def span(rows: slice) -> tuple[int, int]:
    return rows.start, rows.stop


def row(batch: Any, j: int) -> Any:
    """Row ``j`` of a batch laid out by a space (arrays, dicts and tuples of them), a copy."""
    if isinstance(batch, dict):
        return {key: row(value, j) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(row(value, j) for value in batch)
    return np.array(batch[j])


def vector_call(venv: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = getattr(type(venv), "call", None)
    if call is not None and call is not getattr(VectorEnv, "call", None):
        return venv.call(name, *args, **kwargs)
    value = getattr(venv, name)
    return value(*args, **kwargs) if callable(value) else value


Hosted = Sequence[tuple[tuple[int, ...], Any]]
"""Hosted VectorEnvs, each with the ids of its envs."""


def call_venvs(venvs: Hosted, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
    """Call ``name`` on each hosted VectorEnv (``call`` where it has one, one value per env;
    else its own attribute or method, the same value for each of its envs)."""
    values: dict[int, Any] = {}
    failures: list[EnvFailure] = []
    for ids, venv in venvs:
        try:
            got = vector_call(venv, name, args, kwargs)
        except env_errors() as exc:
            failures.extend(EnvFailure.capture_all(ids, Phase.CALL, exc))
            continue
        if isinstance(got, (tuple, list)) and len(got) == len(ids):
            values.update(zip(ids, got, strict=True))
        else:
            values.update((i, got) for i in ids)
    return Reply(values=values, failures=tuple(failures))


def set_venvs(venvs: Hosted, name: str, values: dict[int, Any]) -> Reply:
    """Set ``name`` on each hosted VectorEnv: per env where it has ``set_attr``, else one
    value for all its envs (refused when they differ)."""
    failures: list[EnvFailure] = []
    for ids, venv in venvs:
        mine = [values[i] for i in ids if i in values]
        try:
            if hasattr(venv, "set_attr"):
                venv.set_attr(name, mine)
            elif all(v is mine[0] or v == mine[0] for v in mine):
                setattr(venv, name, mine[0])
            else:
                raise ValueError(
                    f"set_attr({name!r}): the hosted {type(venv).__name__} has no "
                    "set_attr: give every env of its block the same value"
                )
        except env_errors() as exc:
            failures.extend(EnvFailure.capture_all(ids, Phase.CALL, exc))
    return Reply(failures=tuple(failures))


def leaves(value: Any, space: spaces.Space[Any]) -> list[tuple[Any, spaces.Space[Any]]]:
    if isinstance(space, spaces.Dict):
        return [leaf for key, sub in space.spaces.items() for leaf in leaves(value[key], sub)]
    if isinstance(space, spaces.Tuple):
        return [leaf for sub, v in zip(space.spaces, value, strict=True) for leaf in leaves(v, sub)]
    return [(value, space)]


def unbatch_infos(infos: Mapping[str, Any], n: int) -> dict[int, dict[str, Any]]:
    """A vector env's infos (arrays, and ``_key`` masks) as a dict per env that has any
    (by its index in the batch), holding only what that env has: what the pool merges back
    Gymnasium's way. No infos (the common step): nothing done per env."""
    whole = unmasked_arrays(infos)
    if whole is not None:  # a dict per env, filled key by key: no merging per env and key
        dicts: list[dict[str, Any]] = [{} for _ in range(n)] if whole else []
        for key, value in whole:
            for j in range(n):
                dicts[j][key] = value[j]
        return dict(enumerate(dicts))
    out: dict[int, dict[str, Any]] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get("_" + key)
        where = range(n) if mask is None else np.flatnonzero(mask).tolist()
        if isinstance(value, Mapping):
            subs = unbatch_infos(value, n)
            for j in where:
                if j in subs:
                    out.setdefault(j, {})[key] = subs[j]
            continue
        for j in where:
            out.setdefault(j, {})[key] = value[j]
    return dict(sorted(out.items()))


def take_infos(
    info: Mapping[str, Any],
    ids: tuple[int, ...],
    infos: dict[int, Any],
    batched: list[BatchedInfos],
) -> None:
    """A block's (envs ``ids``) infos of a step: kept as arrays in ``batched`` where every env
    fills them alike (:class:`~envfleet.info_columns.BatchedInfos`), else a dict per env that
    has any into ``infos``."""
    arrays = BatchedInfos.of(ids, info)
    if arrays is not None:
        batched.append(arrays)
        return
    for j, env_info in unbatch_infos(info, len(ids)).items():
        infos[ids[0] + j] = env_info


def step_infos(
    infos: dict[int, Any], batched: list[BatchedInfos]
) -> Mapping[int, dict[str, Any]] | None:
    """A step's infos (:func:`take_infos`): those kept as arrays as one
    :class:`~envfleet.info_columns.BatchedInfos` (sent as columns) where no env has a dict;
    else every env's as a dict."""
    if batched and not infos:
        joined = BatchedInfos.join(batched)
        if joined is not None:
            return joined
    for part in batched:
        infos.update(part)
    return infos or None


__all__ = [
    "Hosted",
    "block_views",
    "call_venvs",
    "leaves",
    "row",
    "sends",
    "set_venvs",
    "span",
    "step_infos",
    "take_infos",
    "unbatch_infos",
    "vector_call",
]
