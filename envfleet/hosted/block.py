"""One hosted VectorEnv and the rows of the pool's batch it owns (a :class:`Block` of a
:class:`~envfleet.hosted.group.HostedGroup`), and how it is reset with the pool's seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import VectorEnv

from envfleet.hosted.batches import sends

__all__ = ["Block"]


@dataclass
class Block:
    """One hosted VectorEnv and the rows it owns."""

    index: int
    ids: tuple[int, ...]
    rows: slice
    venv: VectorEnv[Any, Any, Any]
    restarts: int = 0
    owe_truncation: bool = False  # rebuilt: its next step reports the episodes truncated
    owe_reset: bool = False  # rebuilt and reported: its next step resets it (NEXT_STEP)
    per_env_seeds: bool | None = None  # whether its reset takes one seed per env
    sends: bool = False  # its VectorEnv has send/recv of all its envs (looked at once per build)
    views: tuple[Any, ...] = ()  # its rows of the batch, made once (batches.block_views)

    def __post_init__(self) -> None:
        self.sends = sends(self.venv)

    def reset(
        self, seeds: list[int | None], options: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the VectorEnv with a seed per env where it takes them (found out at its first
        seeded reset), else with its first env's."""
        if all(s is None for s in seeds):
            return self.venv.reset(options=options)
        if self.per_env_seeds is not False and len(seeds) == len(self.ids):
            try:
                per_env: Any = np.array(seeds, dtype=np.int64)  # VectorEnv's stub says int
                out = self.venv.reset(seed=per_env, options=options)
                self.per_env_seeds = True
                return out
            except (TypeError, ValueError, gymnasium.error.Error):
                if self.per_env_seeds:
                    raise
                self.per_env_seeds = False  # one seed for the batch: its first env's
        return self.venv.reset(seed=seeds[0], options=options)
