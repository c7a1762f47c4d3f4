"""What ``step``, ``recv`` and ``reset`` return, read from the batch arrays the workers filled.

Rows of the envs handed out, observations as copies (or, with ``copy=False``, views of a run of
consecutive envs), and their infos merged Gymnasium's way; it also notes which envs ended their
episode (the pool's DISABLED-mode check) and tells the stats.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.backends.contract.spares import Spares
from envfleet.buffers import Batch, take, view_rows
from envfleet.infos import merge_infos
from envfleet.ledger import Ledger
from envfleet.stats import StatsRecorder

Results = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]
"""``(observations, rewards, terminations, truncations, infos)``."""


class ResultReader:
    """Reads one pool's results.

    Args:
        batch: the pool's batch arrays.
        space: the single observation space.
        ledger: where the infos of ready envs wait.
        stats: told which envs ended an episode.
        ended: one flag per env, set for the envs whose last result ended their episode.
    """

    def __init__(
        self,
        batch: Batch,
        space: spaces.Space[Any],
        ledger: Ledger,
        stats: StatsRecorder,
        ended: np.ndarray,
    ) -> None:
        self._batch = batch
        self._space = space
        self._ledger = ledger
        self._all_ids = ledger.all_ids
        self._num_envs = ledger.num_envs
        self._stats = stats
        self._ended = ended

    def results(
        self, env_ids: np.ndarray, *, copy: bool | Spares, with_env_id: bool = False
    ) -> Results:
        """The results of ``env_ids`` (ready), in that order; ``copy``: the observations as
        copies, or views (False), or the spare the workers copied them into, if any (a sync
        step of every env)."""
        batch = self._batch
        whole = env_ids is self._all_ids or (
            len(env_ids) == self._num_envs and bool((env_ids[1:] > env_ids[:-1]).all())
        )
        if whole:  # every env in order: plain copies, no fancy indexing
            rows = None
            terminations = batch.terminations.copy()
            truncations = batch.truncations.copy()
            rewards = batch.rewards.copy()
            done = np.bitwise_or(terminations, truncations, self._ended)  # into _ended
        else:
            rows = env_ids
            terminations = batch.terminations[env_ids]
            truncations = batch.truncations[env_ids]
            rewards = batch.rewards[env_ids]
            done = terminations | truncations
            self._ended[env_ids] = done
        self._stats.ended(env_ids, done)
        infos = self.infos(env_ids, positions=None, size=len(env_ids), whole=whole)
        if with_env_id:
            infos["env_id"] = env_ids
        if isinstance(copy, Spares):
            spare = copy.hand_out() if rows is None else None
            return (
                self.observations(rows, True) if spare is None else spare,
                rewards,
                terminations,
                truncations,
                infos,
            )
        return self.observations(rows, copy), rewards, terminations, truncations, infos

    def observations(self, rows: np.ndarray | None, copy: bool) -> Any:
        """The observations of ``rows`` (every env, in order, when ``None``).

        With ``copy=False``, rows that are a run of consecutive envs in order (every env, or
        one worker's block, as double-buffered async batches on two workers are) come as views
        of the batch arrays: ``torch.from_numpy`` then takes them with no copy at all.
        """
        observations = self._batch.observations
        if rows is None and isinstance(observations, np.ndarray):  # one array, every env
            return observations.copy() if copy else observations
        if not copy and not isinstance(observations, list):
            if rows is None:
                return observations
            start, stop = int(rows[0]), int(rows[-1]) + 1
            if stop - start == len(rows) and (len(rows) == 1 or bool((np.diff(rows) == 1).all())):
                return view_rows(self._space, observations, start, stop)
        return take(self._space, observations, rows)

    def infos(
        self, env_ids: np.ndarray, positions: np.ndarray | None, size: int, whole: bool = False
    ) -> dict[str, Any]:
        """The infos of ``env_ids`` merged Gymnasium's way, each at its position in a batch of
        ``size`` (``positions`` ``None``: in order from 0): the dicts the ledger holds and the
        columns the transport delivered into the batch (``whole``: every env, in order)."""
        table = self._batch.infos
        if not table.pending and not self._ledger.infos:  # the common case: no env has any
            return {}
        places = range(len(env_ids)) if positions is None else positions
        pairs = self._ledger.take_infos(env_ids, places)
        if table.pending:
            return table.take(env_ids, positions, size, pairs, whole)
        assert pairs is not None  # the ledger holds infos: else nothing was pending (above)
        return merge_infos(pairs, size)


__all__ = ["ResultReader", "Results"]
