"""Checks on what the caller hands the pool, done before anything reaches a worker.

Each check says what was wrong and what was expected: which env, which action, which space.
As in Gymnasium's vector envs, only the batch (its count and shape) is checked by default;
whether an action lies in the action space is the env's business unless the pool was made with
``check_actions=True``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.error import Error as GymnasiumError
from gymnasium.vector.utils import batch_space, iterate


class SeedValueError(ValueError, GymnasiumError):
    """A negative seed: a ``ValueError``, and the ``gymnasium.error.Error`` that Gymnasium's
    vector envs raise for it (their envs' seeding refuses it)."""


class SeedTypeError(TypeError, GymnasiumError):
    """A seed that is not an int: a ``TypeError``, and the ``gymnasium.error.Error`` that
    Gymnasium's vector envs raise for it."""


class ActionKeyError(KeyError):
    """A batch of ``Dict`` actions without one of the space's keys: a ``KeyError``, as
    Gymnasium's vector envs raise for it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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
    ascending = ids.size < 2 or bool((ids[1:] > ids[:-1]).all())  # as a rule: no repeats then
    if not ascending and np.unique(ids).size != ids.size:
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"env_id repeats envs {values[counts > 1].tolist()}")
    if ids.size == 0:
        raise ValueError("env_id is empty: send at least one env")
    return ids


_FLAT_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def check_actions(
    space: spaces.Space[Any], actions: Any, env_ids: np.ndarray, *, check_membership: bool = False
) -> Any:
    """Validate a batch of actions for ``env_ids``; return it as the pool will send it.

    The batch's count and shape are always checked, with the exception types Gymnasium's vector
    envs raise for the same mistake (``TypeError`` for a scalar, ``ValueError`` for a wrong
    count). Whether each action lies in ``space`` is left to the env, as Gymnasium does, unless
    ``check_membership``. Values are never converted here: the caller's dtype reaches the env.
    """
    count = len(env_ids)
    if isinstance(space, _FLAT_SPACES):
        arr = actions if isinstance(actions, np.ndarray) else np.asarray(actions)
        if arr.ndim == 0:
            raise TypeError(
                f"expected a batch of {count} actions (one per env, action space {space}), "
                f"got the scalar {actions!r}"
            )
        expected = (count, *(space.shape or ()))
        if arr.shape != expected:  # a wrong count too: Gymnasium raises ValueError for both
            raise ValueError(
                f"expected actions of shape {expected} ({count} envs, action space {space}), "
                f"got shape {arr.shape}"
            )
        if check_membership:
            _check_members(space, arr, env_ids)
        return arr
    return _check_items(space, actions, env_ids, check_membership)


class ActionCheck:
    """:func:`check_actions` for one pool's action space, with the shape of a batch of every
    env worked out once: the sync step's check of a flat space is then one comparison (any
    other batch, and every refusal, goes through :func:`check_actions`).

    Args:
        space: the single action space.
        num_envs: envs of the pool.
    """

    def __init__(self, space: spaces.Space[Any], num_envs: int) -> None:
        self._space = space
        self._shape: tuple[int, ...] | None = None
        if isinstance(space, _FLAT_SPACES) and space.shape is not None:
            self._shape = (num_envs, *space.shape)

    def __call__(self, actions: Any, env_ids: np.ndarray, check_membership: bool) -> Any:
        """``check_actions(space, actions, env_ids, check_membership=check_membership)``."""
        shape = self._shape
        if shape is not None and len(env_ids) == shape[0]:
            arr = actions if isinstance(actions, np.ndarray) else np.asarray(actions)
            if arr.shape == shape:
                if check_membership:
                    _check_members(self._space, arr, env_ids)
                return arr
        return check_actions(self._space, actions, env_ids, check_membership=check_membership)


def _check_members(space: spaces.Space[Any], arr: np.ndarray, env_ids: np.ndarray) -> None:
    """``check_actions=True``: refuse actions detectably outside ``space`` (Box bounds aside)."""
    count = len(env_ids)
    if isinstance(space, spaces.Box):
        kinds = "iub" if np.issubdtype(space.dtype, np.integer) else "iubf"
        _check_kind(space, arr, kinds, f"{space.dtype}-compatible")
        return
    _check_kind(space, arr, "iub", "integer")
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


def _check_kind(space: spaces.Space[Any], arr: np.ndarray, kinds: str, what: str) -> None:
    if arr.dtype.kind not in kinds:
        raise TypeError(f"expected {what} actions for action space {space}, got dtype {arr.dtype}")


def _check_items(
    space: spaces.Space[Any], actions: Any, env_ids: np.ndarray, check_membership: bool
) -> Any:
    """Dict, Tuple and other spaces: split the batch per env (and check each, if asked)."""
    batched = batch_space(space, len(env_ids))
    try:
        items = list(iterate(batched, actions))
    except TypeError as exc:  # a scalar, or no batch at all: Gymnasium's iterate raises so too
        raise TypeError(
            f"actions do not form a batch of {len(env_ids)} for action space {space}: {exc}"
        ) from exc
    except KeyError as exc:  # a Dict batch without one of the keys: so does Gymnasium's
        raise ActionKeyError(
            f"actions do not form a batch of {len(env_ids)} for action space {space}: no key {exc}"
        ) from exc
    except IndexError as exc:  # a Tuple batch without one of its parts: so does Gymnasium's
        raise IndexError(
            f"actions do not form a batch of {len(env_ids)} for action space {space}: "
            f"a part is missing ({exc})"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"actions do not form a batch of {len(env_ids)} for action space {space}: {exc}"
        ) from exc
    if len(items) != len(env_ids):
        raise ValueError(f"expected {len(env_ids)} actions (one per env), got {len(items)}")
    if check_membership:
        for env, item in zip(env_ids.tolist(), items, strict=True):
            try:
                inside = bool(space.contains(item))
            except Exception as exc:  # a custom space whose contains cannot take the value
                raise ValueError(
                    f"action {item!r} for env {env} could not be checked against the action "
                    f"space {space}: its contains() raised {type(exc).__name__}: {exc}"
                ) from exc
            if not inside:
                raise ValueError(
                    f"action {item!r} for env {env} is outside the action space {space}"
                )
    return actions


def keeps_dtype(space: spaces.Space[Any], actions: Any) -> bool:
    """Whether storing ``actions`` in arrays laid out from ``space`` keeps every value as is.

    Only when each leaf already has the space's dtype: any other dtype (float64 actions for a
    float32 Box, an int64 action for a uint8 Box) would be cast, so such actions travel with
    the command instead, exactly as the caller gave them.
    """
    if isinstance(space, spaces.Dict):
        return isinstance(actions, Mapping) and all(
            key in actions and keeps_dtype(sub, actions[key]) for key, sub in space.spaces.items()
        )
    if isinstance(space, spaces.Tuple):
        return (
            isinstance(actions, tuple | list)
            and len(actions) == len(space.spaces)
            and all(keeps_dtype(sub, a) for sub, a in zip(space.spaces, actions, strict=True))
        )
    dtype = actions.dtype if isinstance(actions, np.ndarray) else np.asarray(actions).dtype
    return bool(dtype == space.dtype)


def same_space(a: spaces.Space[Any], b: spaces.Space[Any]) -> bool:
    """Whether ``a == b`` as Gymnasium's ``Space.__eq__`` says, without its cost on large
    ``Box`` spaces: their type, shape and dtype first, then their bounds compared exactly
    (``np.array_equal``); only bounds that differ go to ``Box.__eq__``'s ``np.allclose``, which
    takes seconds on a 50 MB image space (every env of a pool is checked at start-up).
    ``Dict`` and ``Tuple`` compare their subspaces this way, in Gymnasium's order."""
    if a is b:
        return True
    if isinstance(a, spaces.Box) and isinstance(b, spaces.Box):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if np.array_equal(a.low, b.low) and np.array_equal(a.high, b.high):
            return True
        return bool(a == b)  # bounds that differ: Gymnasium's tolerance decides
    if isinstance(a, spaces.Dict) and isinstance(b, spaces.Dict):
        return list(a.spaces) == list(b.spaces) and all(
            same_space(a.spaces[key], b.spaces[key]) for key in a.spaces
        )
    if isinstance(a, spaces.Tuple) and isinstance(b, spaces.Tuple):
        return len(a.spaces) == len(b.spaces) and all(
            same_space(x, y) for x, y in zip(a.spaces, b.spaces, strict=True)
        )
    return bool(a == b)


def bounds_nbytes(space: spaces.Space[Any]) -> int:
    """Bytes the bounds of ``space``'s ``Box`` spaces hold (what makes a space costly to send
    and to compare)."""
    if isinstance(space, spaces.Box):
        return int(space.low.nbytes + space.high.nbytes)
    if isinstance(space, spaces.Dict):
        return sum(bounds_nbytes(sub) for sub in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return sum(bounds_nbytes(sub) for sub in space.spaces)
    return 0


# -- reset's arguments ----------------------------------------------------------------------


def check_close_timeout(timeout: float | None, default: float) -> float:
    """``close``'s ``timeout``: a finite number of seconds, ``None`` meaning ``default``."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.number):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not math.isfinite(timeout):  # nan broke the process close half-way (workers left)
        raise ValueError(
            f"timeout must be a finite number of seconds (None: the default bound), got {timeout!r}"
        )
    return timeout


def check_memory_limit(limit: Any) -> int | None:
    """A ``worker_memory_limit`` set on a pool: ``None`` or a positive int (of bytes)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int | np.integer):
        raise TypeError(f"worker_memory_limit must be an int or None, got {limit!r}")
    if limit < 1:
        raise ValueError(f"worker_memory_limit must be at least 1, got {limit}")
    return int(limit)


def check_attr_values(name: str, values: Any, num_envs: int) -> list[Any] | tuple[Any, ...]:
    """``set_attr``'s ``values``: one per env, or one value (not a list or tuple) for all."""
    if not isinstance(values, list | tuple):
        return [values] * num_envs
    if len(values) != num_envs:
        raise ValueError(
            f"set_attr({name!r}) needs one value per env ({num_envs}), got {len(values)}"
        )
    return values


def check_options(options: Any) -> dict[str, Any] | None:
    """``reset``'s ``options`` as a new dict (``None`` stays ``None``)."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options must be a dict (of keyword options for each env's reset) or None, "
            f"got {type(options).__name__} {options!r}"
        )
    return dict(options)


def check_reset_mask(mask: Any, num_envs: int) -> np.ndarray:
    """``options["reset_mask"]``: a bool array of shape ``(num_envs,)`` selecting some env."""
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"options['reset_mask'] must be a numpy array, got {type(mask)}")
    if mask.shape != (num_envs,):
        raise ValueError(f"options['reset_mask'] must have shape ({num_envs},), got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"options['reset_mask'] must have dtype bool, got {mask.dtype}")
    if not mask.any():
        raise ValueError("options['reset_mask'] must select at least one env")
    return mask


def check_seeds(
    seed: int | Sequence[int | None] | None, env_ids: np.ndarray, per_env: int, num_envs: int
) -> list[int | None]:
    """One seed (or ``None``) for each of ``env_ids`` from ``reset``'s ``seed``: ``None``, an
    int ``s`` (env ``i`` gets ``s + i``) or ``per_env`` seeds (one per env of the pool when
    ``per_env == num_envs``, else one per env of ``env_ids``)."""
    if seed is None:
        return [None] * len(env_ids)
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool):
        if seed < 0:
            raise SeedValueError(f"seed must be a non-negative int, got {seed}")
        return [int(seed) + int(i) for i in env_ids]
    if isinstance(seed, str | bytes) or not isinstance(seed, Iterable):
        raise TypeError(f"seed must be None, an int or one int (or None) per env, got {seed!r}")
    seeds = list(seed)
    if len(seeds) != per_env:
        raise ValueError(f"expected {per_env} seeds (one per env), got {len(seeds)}")
    for k, s in enumerate(seeds):
        if s is None:
            continue
        if isinstance(s, bool) or not isinstance(s, int | np.integer):
            raise SeedTypeError(f"seed[{k}] must be an int or None, got {s!r}")
        if s < 0:
            raise SeedValueError(f"seed[{k}] must be a non-negative int, got {s}")
    seeds = [None if s is None else int(s) for s in seeds]
    if per_env == num_envs:
        return [seeds[i] for i in env_ids]
    return seeds


__all__ = [
    "ActionCheck",
    "ActionKeyError",
    "SeedTypeError",
    "SeedValueError",
    "bounds_nbytes",
    "check_actions",
    "check_attr_values",
    "check_close_timeout",
    "check_env_ids",
    "check_memory_limit",
    "check_options",
    "check_reset_mask",
    "check_seeds",
    "keeps_dtype",
    "same_space",
]
