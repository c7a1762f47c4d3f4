"""Where a node's workers record their rollouts' parts: blocks of the agent's shared memory.

Each worker records its part of a rollout in a block of the agent's shared memory
(:mod:`envfleet.shared_records`), in place, or has it read from its pipe into the block; the
agent sends the part from there (:mod:`~envfleet.backends.contract.raw_parts`). A worker's
parts go round the same few blocks, which it keeps mapped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import gymnasium
import numpy as np

from envfleet.backends.contract.base import LandsParts, WorkerLost
from envfleet.protocol import Command, Reply, Sample
from envfleet.recycling import Recycler
from envfleet.rollout_loop import Sampled, placed, record_arrays

__all__ = ["PartBlocks"]


class PartBlocks:
    """The blocks a node's workers record their parts in, by the Sample, till answered.

    Args:
        local: the local pool that lands the parts.
        spaces: the observation and action spaces.
        rewards: the rewards' dtype.
        workers: how many workers (each keeps a free block between its parts).
    """

    def __init__(
        self,
        local: LandsParts,
        spaces: tuple[gymnasium.Space[Any], gymnasium.Space[Any]],
        rewards: np.dtype[Any],
        workers: int,
    ) -> None:
        self.local = local
        self.obs_space, self.act_space = spaces
        self.rewards = rewards
        self.memory = Recycler(shared=True)
        self.memory.keep_at_least(workers + 2)  # a free block each between its parts
        self.records: dict[Command, Sampled] = {}

    def record(self, worker: int, command: Sample) -> None:
        """Give ``worker`` a block to record its part of ``command`` in (in place, or read
        there from its pipe)."""
        steps, count = command.steps, len(command.env_ids)
        # Each worker's parts in the same few blocks again: it keeps them mapped.
        empty = functools.partial(self.memory.empty, hint=worker)
        fields = record_arrays(self.obs_space, self.act_space, steps, count, self.rewards, empty)
        into = Sampled(command.env_ids, steps, *fields, {}, {}, None)
        self.local.land(worker, command, into)
        self.records[command] = into

    def forget(self, command: Command) -> None:
        """``command`` will not be answered (its worker is lost or rebuilt)."""
        self.records.pop(command, None)

    def placed(self, held: Iterable[tuple[int, Command | None, Reply | WorkerLost | None]]) -> None:
        """The parts recorded in place among ``held`` (worker, command, reply), holding the
        arrays they were recorded in (sent from there)."""
        for _, command, reply in held:
            into = self.records.pop(command, None) if command is not None else None
            if into is None or not isinstance(reply, Reply) or not reply.values:
                continue
            got = reply.values.get(into.env_ids[0])
            if isinstance(got, Sampled) and got.in_place:
                reply.values[into.env_ids[0]] = placed(got, into, self.obs_space, self.act_space)

    def clear(self) -> None:
        """Let go of every block."""
        self.memory.clear()
