"""Checks on what the caller hands the pool, done before anything reaches a worker.

Each check says what was wrong and what was expected: which env, which action, which space.
Continuous (Box) actions outside the bounds are passed through, as Gymnasium envs clip them;
everything else that is detectably outside the action space is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, iterate


def check_env_ids(env_id: Sequence[int] | np.ndarray | None, num_envs: int) -> np.ndarray:
    """Env ids as a 1-D int array: in range, no repeats; ``None`` means every env."""
    if env_id is None:
        return np.arange(num_envs)
    ids = np.asarray(env_id)
    if ids.ndim == 0:
        ids = ids.reshape(1)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"env_id must be a 1-D sequence of ints, got {env_id!r}")
    # Range-checked in the caller's dtype: a uint64 beyond intp would wrap around when cast.
    bad = ids[(ids < 0) | (ids >= num_envs)]
    if bad.size:
        raise ValueError(f"env_id {bad.tolist()} out of range: the pool has envs 0..{num_envs - 1}")
    ids = ids.astype(np.intp, copy=False)
    if np.unique(ids).size != ids.size:
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"env_id repeats envs {values[counts > 1].tolist()}")
    if ids.size == 0:
        raise ValueError("env_id is empty: send at least one env")
    return ids


def check_actions(space: spaces.Space[Any], actions: Any, env_ids: np.ndarray) -> Any:
    """Validate a batch of actions for ``env_ids``; return it as the pool will store it."""
    count = len(env_ids)
    if isinstance(space, spaces.Discrete | spaces.MultiDiscrete | spaces.MultiBinary):
        arr = _array(space, actions, count, kinds="iub", what="integer")
        if isinstance(space, spaces.Discrete):
            low, high = space.start, space.start + space.n - 1
        elif isinstance(space, spaces.MultiDiscrete):
            low, high = space.start, space.start + space.nvec - 1
        else:
            low, high = 0, 1
        outside = (arr < low) | (arr > high)
        if outside.any():
            row = int(np.flatnonzero(outside.reshape(count, -1).any(axis=1))[0])
            raise ValueError(
                f"action {arr[row].tolist()} for env {int(env_ids[row])} is outside the action "
                f"space {space}"
            )
        return arr
    if isinstance(space, spaces.Box):
        kinds = "iub" if np.issubdtype(space.dtype, np.integer) else "iubf"
        return _array(space, actions, count, kinds=kinds, what=f"{space.dtype}-compatible")
    return _check_items(space, actions, env_ids)


def _array(space: spaces.Space[Any], actions: Any, count: int, kinds: str, what: str) -> np.ndarray:
    arr = np.asarray(actions)
    expected = (count, *space.shape)  # type: ignore[misc]
    if arr.shape != expected:
        raise ValueError(
            f"expected actions of shape {expected} ({count} envs, action space {space}), "
            f"got shape {arr.shape}"
        )
    if arr.dtype.kind not in kinds:
        raise TypeError(f"expected {what} actions for action space {space}, got dtype {arr.dtype}")
    return arr


def _check_items(space: spaces.Space[Any], actions: Any, env_ids: np.ndarray) -> Any:
    """Dict, Tuple and other spaces: check each env's action against the single space."""
    batched = batch_space(space, len(env_ids))
    try:
        items = list(iterate(batched, actions))
    except Exception as exc:
        raise ValueError(
            f"actions do not form a batch of {len(env_ids)} for action space {space}: {exc}"
        ) from exc
    if len(items) != len(env_ids):
        raise ValueError(f"expected {len(env_ids)} actions, got {len(items)}")
    for env, item in zip(env_ids.tolist(), items, strict=True):
        if not space.contains(item):
            raise ValueError(f"action {item!r} for env {env} is outside the action space {space}")
    return actions
