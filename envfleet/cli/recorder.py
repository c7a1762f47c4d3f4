"""Saving a rollout: the ``.npz`` file that ``envfleet run --out FILE.npz`` writes.

One row per env-step in the order the steps were returned (within a batch, in ``env_ids``
order):

* ``env_ids`` (int64): the env that took the step;
* ``actions``: the action sent to it (a Dict/Tuple action space gives ``actions.KEY`` /
  ``actions.INDEX`` arrays instead);
* ``rewards``, ``terminations``, ``truncations``: what the step returned;
* ``autoreset`` (bool): the row is a ``NEXT_STEP`` reset step (its action was ignored, its
  reward is 0): it is part of no episode;
* ``observations`` (only with ``--save-obs``): the observation the action was chosen from.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from envfleet.cli.common import BoolArray, IntArray, UsageError

_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _allocate(space: spaces.Space[Any], n: int, what: str) -> Any:
    """Per-env rows for values of ``space``: an array, or a dict/tuple nest of arrays."""
    if isinstance(space, _ARRAY_SPACES):
        return np.zeros((n, *(space.shape or ())), dtype=space.dtype)
    if isinstance(space, spaces.Dict):
        return {key: _allocate(sub, n, what) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_allocate(sub, n, what) for sub in space.spaces)
    raise UsageError(
        f"--out cannot save {what} of space {space}: only Box, Discrete, MultiDiscrete, "
        "MultiBinary and Dict/Tuple nests of them are supported"
    )


def _put(rows: Any, env_ids: IntArray, values: Any) -> None:
    if isinstance(rows, dict):
        for key, sub in rows.items():
            _put(sub, env_ids, values[key])
    elif isinstance(rows, tuple):
        for sub, value in zip(rows, values, strict=True):
            _put(sub, env_ids, value)
    else:
        rows[env_ids] = values


def _flatten(prefix: str, rows: Any, env_ids: IntArray) -> dict[str, npt.NDArray[Any]]:
    """Copies of rows ``env_ids``, one array per leaf, named ``prefix.key...``."""
    if isinstance(rows, dict):
        return {
            name: array
            for key, sub in rows.items()
            for name, array in _flatten(f"{prefix}.{key}", sub, env_ids).items()
        }
    if isinstance(rows, tuple):
        return {
            name: array
            for index, sub in enumerate(rows)
            for name, array in _flatten(f"{prefix}.{index}", sub, env_ids).items()
        }
    return {prefix: rows[env_ids]}


class Recorder:
    """Collects the rollout row by row and writes it as an ``.npz`` (see the module doc)."""

    def __init__(
        self,
        num_envs: int,
        action_space: spaces.Space[Any],
        observation_space: spaces.Space[Any],
        save_obs: bool,
    ) -> None:
        self._actions = _allocate(action_space, num_envs, "actions")
        self._observations = (
            _allocate(observation_space, num_envs, "observations") if save_obs else None
        )
        self._columns: defaultdict[str, list[npt.NDArray[Any]]] = defaultdict(list)

    def sent(self, env_ids: IntArray, observations: Any, actions: Any) -> None:
        """Remember what each env of ``env_ids`` was sent, until its result comes back."""
        _put(self._actions, env_ids, actions)
        if self._observations is not None:
            _put(self._observations, env_ids, observations)

    def received(
        self,
        env_ids: IntArray,
        rewards: npt.NDArray[Any],
        terminations: BoolArray,
        truncations: BoolArray,
        autoreset: BoolArray,
    ) -> None:
        """Add one row per env of ``env_ids`` (each must have been :meth:`sent` an action)."""
        columns = self._columns
        columns["env_ids"].append(np.array(env_ids, dtype=np.int64))
        for name, array in _flatten("actions", self._actions, env_ids).items():
            columns[name].append(array)
        columns["rewards"].append(np.array(rewards))
        columns["terminations"].append(np.array(terminations, dtype=np.bool_))
        columns["truncations"].append(np.array(truncations, dtype=np.bool_))
        columns["autoreset"].append(np.array(autoreset, dtype=np.bool_))
        if self._observations is not None:
            for name, array in _flatten("observations", self._observations, env_ids).items():
                columns[name].append(array)

    def save(self, path: Path) -> None:
        # An interrupt may land between two appends: keep the batches every column has.
        batches = min((len(chunks) for chunks in self._columns.values()), default=0)
        # Any: as keywords, numpy's stub would let a column fill its ``allow_pickle`` flag.
        arrays: dict[str, Any] = {
            name: np.concatenate(chunks[:batches]) for name, chunks in self._columns.items()
        }
        with path.open("wb") as file:
            np.savez_compressed(file, **arrays)


__all__ = ["Recorder"]
