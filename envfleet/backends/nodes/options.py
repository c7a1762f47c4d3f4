"""A node's options for its workers, in a module of its own that imports no Ray: the workers
unpickle them, and would otherwise import Ray with the agent's module (~0.4 s of CPU and ~40
MB a worker here) though they never use it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from envfleet.backends.contract.base import TransportOptions

__all__ = ["DEFAULT_CONTEXT", "NodeOptions", "node_options"]

DEFAULT_CONTEXT = "forkserver"
"""How the agent starts its worker processes: a Ray worker runs threads, which ``fork`` would
copy in whatever state they are; a fork server is started clean once."""


@dataclass(frozen=True)
class NodeOptions(TransportOptions):
    """A pool's options for one node's workers: their envs keep their global indices (rows of a
    batch as large as the whole pool's)."""

    rows: int = 0

    @property
    def num_envs(self) -> int:
        return self.rows


def node_options(options: TransportOptions, workers: Sequence[int]) -> NodeOptions:
    """``options`` for the node that runs ``workers`` (global worker indices)."""
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    values["assignment"] = [tuple(options.assignment[w]) for w in workers]
    values["context"] = options.context or DEFAULT_CONTEXT
    return NodeOptions(**values, rows=options.num_envs)
