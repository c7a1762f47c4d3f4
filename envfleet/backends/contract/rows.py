"""Rows that travel: packed by a worker, written into the pool's batch by its transport.

Most workers write their envs' rows where the pool reads them (shared memory, or the pool's
own arrays), and their replies carry none. A worker that cannot (a Ray actor on another
machine; observations of a space that shared memory cannot hold, such as Text or Graph)
ships them: :func:`pack` puts them on the reply as :class:`~envfleet.protocol.Rows`, and the
transport's pool side writes them into its batch with :func:`deliver` before its ``wait``
returns the reply. Which rows travel is the transport's choice alone: the stepping loop
(:mod:`envfleet.group`) never knows. :class:`Shipping` does it for a whole group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.buffers import Batch, ObjectRows, put, take
from envfleet.protocol import Group, Reply, Rows


def pack(
    batch: Batch, observation_space: gymnasium.Space[Any], reply: Reply, results: bool
) -> Rows | None:
    """The rows of the envs ``reply`` delivered (those that did not fail), from ``batch``.

    ``results``: rewards, terminations and truncations travel too (else only observations:
    the rest is in shared memory). ``None`` when no env delivered.
    """
    failed = {f.env_index for f in reply.failures}
    ids = np.array(
        [i for i in reply.env_ids if i not in failed] if failed else reply.env_ids, dtype=np.intp
    )
    if not len(ids):
        return None
    observations = batch.observations
    rows = Rows(
        env_ids=ids,
        # Spaces that are not arrays travel as a list of per-env values.
        observations=[observations[i] for i in ids.tolist()]
        if isinstance(observations, ObjectRows)
        else take(observation_space, observations, ids),
    )
    if results:
        rows.rewards = batch.rewards[ids]
        rows.terminations = batch.terminations[ids]
        rows.truncations = batch.truncations[ids]
    return rows


def deliver(batch: Batch, observation_space: gymnasium.Space[Any], reply: Reply) -> Reply:
    """Write the rows ``reply`` shipped into ``batch``; returns ``reply``, rows taken off.

    The observations of the envs the reply names ``kept`` are not written: theirs stand as the
    pool has them.
    """
    rows = reply.rows
    if rows is None:
        return reply
    reply.rows = None
    ids = rows.env_ids
    if rows.rewards is not None:
        batch.rewards[ids] = rows.rewards
        batch.terminations[ids] = rows.terminations
        batch.truncations[ids] = rows.truncations
    observations = rows.observations
    if reply.kept:  # rare: a restarted env whose latest observation stands
        written = np.flatnonzero(~np.isin(ids, reply.kept))
        ids = ids[written]
        if isinstance(observations, list):
            observations = [observations[k] for k in written.tolist()]
        else:
            observations = take(observation_space, observations, written)
    if isinstance(batch.observations, list):
        for k, i in enumerate(ids.tolist()):
            batch.observations[i] = observations[k]
    else:
        put(observation_space, batch.observations, ids, observations)
    return reply


def row_bytes(batch: Batch, num_envs: int) -> int | None:
    """Bytes of one env's rows, as they travel (``None`` when observations are not arrays)."""
    if isinstance(batch.observations, ObjectRows):
        return None
    leaves = [batch.observations, batch.rewards, batch.terminations, batch.truncations]
    total = 0
    while leaves:
        leaf = leaves.pop()
        if isinstance(leaf, dict):
            leaves.extend(leaf.values())
        elif isinstance(leaf, tuple):
            leaves.extend(leaf)
        else:
            total += leaf.nbytes
    return -(-total // num_envs)


class Shipping:
    """A group whose step and reset replies carry their rows (:func:`pack`): for a worker whose
    rows the pool cannot read where the group writes them."""

    def __init__(
        self,
        group: Group,
        batch: Batch,
        observation_space: gymnasium.Space[Any],
        results: bool = False,
    ) -> None:
        self.group = group
        self._batch = batch
        self._space = observation_space
        self._results = results

    @property
    def batch(self) -> Batch:
        return self.group.batch

    @property
    def mode(self) -> AutoresetMode:
        return self.group.mode

    @property
    def observation_space(self) -> gymnasium.Space[Any]:
        return self.group.observation_space

    @property
    def action_space(self) -> gymnasium.Space[Any]:
        return self.group.action_space

    def _packed(self, reply: Reply) -> Reply:
        reply.rows = pack(self._batch, self._space, reply, self._results)
        return reply

    def reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> Reply:
        return self._packed(self.group.reset(env_ids, seeds, options))

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        return self._packed(self.group.step(env_ids, actions))

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        return self.group.call(name, args, kwargs)

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        return self.group.set_attr(name, values)

    def close(self) -> Reply:
        return self.group.close()


__all__ = ["Shipping", "deliver", "pack", "row_bytes"]
