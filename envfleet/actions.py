"""Where a step's actions go: into the batch arrays the workers read, or along with the command.

The pool checks the actions (:mod:`envfleet.validation`), then an :class:`ActionWriter` puts
them where they reach each env exactly as the caller gave them: actions of the space's own
dtype into the batch's action rows (one assignment for a flat space, the sync step's path);
any other (a space that is not arrays, or another dtype, which the batch arrays would cast)
travel with the command, per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, iterate

from envfleet.buffers import is_array_space, put
from envfleet.validation import keeps_dtype

_FLAT_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class ActionWriter:
    """Writes checked actions for one pool.

    Args:
        space: the single action space.
        batch_actions: the batch's action rows (what :class:`~envfleet.buffers.Batch` holds).
        all_ids: the pool's array of every env id (the sync step passes this very array).
        worker_of: the worker holding each env.
        num_workers: workers of the pool.
    """

    def __init__(
        self,
        space: spaces.Space[Any],
        batch_actions: Any,
        all_ids: np.ndarray,
        worker_of: np.ndarray,
        num_workers: int,
    ) -> None:
        self._space = space
        self._batch_actions = batch_actions
        self._all_ids = all_ids
        self._worker_of = worker_of
        self._num_workers = num_workers
        self._array = is_array_space(space)
        # A flat action space (one array of the space's dtype): actions of that dtype are
        # written with one assignment, without walking the space (the sync step's path).
        self._flat: np.ndarray | None = (
            batch_actions
            if isinstance(space, _FLAT_SPACES)
            and isinstance(batch_actions, np.ndarray)
            and batch_actions.dtype == space.dtype
            else None
        )

    def write(self, actions: Any, env_ids: np.ndarray) -> Sequence[dict[int, Any]] | None:
        """Put ``actions`` (checked, one per env of ``env_ids``) where they go: ``None`` when
        they are in the batch; else, per worker, the actions its command carries."""
        flat = self._flat
        if flat is not None and actions.dtype == flat.dtype:  # checked: an array for these spaces
            if env_ids is self._all_ids:
                flat[...] = actions
            else:
                flat[env_ids] = actions
            return None
        space = self._space
        if self._array and keeps_dtype(space, actions):
            put(space, self._batch_actions, None if env_ids is self._all_ids else env_ids, actions)
            return None
        # Another dtype would be cast by the batch arrays: these travel with the command, so
        # the env gets exactly what the caller gave (fidelity).
        if isinstance(actions, np.ndarray):
            items = list(actions)
        else:
            items = list(iterate(batch_space(space, len(env_ids)), actions))
        carried = [dict[int, Any]() for _ in range(self._num_workers)]
        worker_of = self._worker_of
        for i, item in zip(env_ids.tolist(), items, strict=True):
            carried[worker_of[i]][i] = item
        return carried


__all__ = ["ActionWriter"]
