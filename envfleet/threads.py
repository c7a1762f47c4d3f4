"""Several env groups stepped on threads inside one worker (``threads_per_worker``).

A worker of the process backend holds one :class:`ThreadedGroup` instead of one
:class:`~envfleet.group.EnvGroup` when its envs sleep or release the GIL: each command is split
by env over sub-groups that run at once on persistent threads, and their replies are merged into
one. The stepping loop stays the one in ``group.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from envfleet.group import EnvGroup
from envfleet.protocol import Reply


def merge_replies(replies: Sequence[Reply]) -> Reply:
    """One reply from the replies of several sub-groups."""
    infos: dict[int, dict[str, Any]] = {}
    values: dict[int, Any] = {}
    for reply in replies:
        infos.update(reply.infos or {})
        values.update(reply.values or {})
    return Reply(
        env_ids=tuple(i for r in replies for i in r.env_ids),
        infos=infos or None,
        values=values or None,
        failures=tuple(f for r in replies for f in r.failures),
        restarts=tuple(f for r in replies for f in r.restarts),
        kept=tuple(i for r in replies for i in r.kept),
    )


class ThreadedGroup:
    """The :class:`EnvGroup` interface over sub-groups run on ``len(groups)`` threads."""

    def __init__(self, groups: Sequence[EnvGroup]) -> None:
        self.groups = list(groups)
        first = self.groups[0]  # every sub-group shares the worker's batch, mode and spaces
        self.batch = first.batch
        self.mode = first.mode
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        self._owner = {i: k for k, g in enumerate(self.groups) for i in g.env_ids}
        self._executor = ThreadPoolExecutor(len(self.groups), thread_name_prefix="envfleet-env")

    def _split(self, env_ids: Sequence[int]) -> list[tuple[int, list[int]]]:
        parts: dict[int, list[int]] = {}
        for i in env_ids:
            parts.setdefault(self._owner[i], []).append(i)
        return sorted(parts.items())

    def _run(self, calls: list[Any]) -> Reply:
        if len(calls) == 1:
            reply: Reply = calls[0]()
            return reply
        return merge_replies(list(self._executor.map(lambda call: call(), calls)))

    def reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> Reply:
        seed_of = dict(zip(env_ids, seeds, strict=True))
        return self._run(
            [
                _bind(self.groups[k].reset, ids, [seed_of[i] for i in ids], options)
                for k, ids in self._split(env_ids)
            ]
        )

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        calls = []
        for k, ids in self._split(env_ids):
            part = None if actions is None else {i: actions[i] for i in ids}
            calls.append(_bind(self.groups[k].step, ids, part))
        return self._run(calls)

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        return self._run([_bind(g.call, name, args, kwargs) for g in self.groups])

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        return self._run(
            [
                _bind(self.groups[k].set_attr, name, {i: values[i] for i in ids})
                for k, ids in self._split(list(values))
            ]
        )

    def close(self) -> Reply:
        try:
            return self._run([g.close for g in self.groups])
        finally:
            self._executor.shutdown(wait=False)


def _bind(method: Any, *args: Any) -> Any:
    return lambda: method(*args)


def split_ids(env_ids: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``env_ids`` in ``parts`` contiguous blocks (fewer when there are fewer envs)."""
    blocks = np.array_split(np.asarray(env_ids), min(parts, len(env_ids)))
    return [tuple(int(i) for i in block) for block in blocks]


__all__ = ["ThreadedGroup", "merge_replies", "split_ids"]
