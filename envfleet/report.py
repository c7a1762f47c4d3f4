"""What a pool reports about itself: :meth:`Pool.stats <envfleet.Pool.stats>`,
:meth:`Pool.describe <envfleet.Pool.describe>`, its restarts and its ``repr``.

Each is assembled from the parts that hold the figures: the statistics recorder (latency, idle
time, steps, episodes), recovery (restarts, workers recycled), the ledger (what is in flight and
ready) and the dispatch (per node, the transport's layout and traffic). Reading them changes
nothing, so :meth:`Report.describe` is safe from another thread while a step waits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from envfleet.dispatch import Dispatch
from envfleet.ledger import Ledger
from envfleet.recovery import Recovery
from envfleet.stats import PoolStats, StatsRecorder, node_layout


class Report:
    """The figures of one pool, assembled on request.

    Args:
        stats: the pool's statistics recorder.
        ledger: the pool's ledger.
        recovery: the pool's recovery.
        dispatch: the pool's dispatch (the nodes of a cluster).
    """

    def __init__(
        self, stats: StatsRecorder, ledger: Ledger, recovery: Recovery, dispatch: Dispatch
    ) -> None:
        self._stats = stats
        self._ledger = ledger
        self._recovery = recovery
        self._dispatch = dispatch

    def stats(self) -> PoolStats:
        """``Pool.stats``: the figures since the pool was made, per node on a cluster."""
        recovery = self._recovery
        stats = self._stats.snapshot(recovery.restarts, recovery.recycled)
        nodes = self._dispatch.nodes()
        return dataclasses.replace(stats, nodes=nodes) if nodes else stats

    def describe(self) -> dict[str, Any]:
        """``Pool.describe``: the ledger's snapshot and each env's restarts, as plain values."""
        return {**self._ledger.snapshot(), "restarts": self._recovery.restarts.tolist()}

    def restarts(self) -> np.ndarray:
        """A copy of how many times each env has been restarted."""
        restarts: np.ndarray = self._recovery.restarts.copy()
        return restarts

    def summary(self, batch_size: int, closed: bool) -> str:
        """``repr(pool)``: the env, its envs, workers and batch size, and where the nodes are."""
        ledger = self._ledger
        nodes = "" if closed else node_layout(self._dispatch.nodes())
        return (
            f"Pool({self._recovery.env_name}, num_envs={ledger.num_envs}, "
            f"workers={ledger.num_workers}, batch_size={batch_size}{nodes})"
        )


__all__ = ["Report"]
