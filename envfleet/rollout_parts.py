"""A pool's rollout parts in flight (:class:`RolloutParts`): each worker's parts out (sent,
their replies not yet in) and in (not yet handed over, in the order they came in).

A worker may have :data:`QUEUED_MOST` parts outstanding: the one it records and one queued
behind it (``rollout_async(..., queue=True)``), which it starts as soon as the first ends, with
no round trip to the pool in between. Its parts are handed over one a hand-over, in the order
they came in, which is the order the worker ran them (a part sent again, to a worker rebuilt
since, runs after those sent before it): a :class:`~envfleet.Rollout` holds each env's steps
once, and its envs' rows are left as the last part run left them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from envfleet.protocol import Reply, Sample
from envfleet.rollout_loop import Sampled
from envfleet.rollouts import Out

__all__ = [
    "QUEUED_MOST",
    "Part",
    "RolloutParts",
    "check_max_lag",
    "check_min_envs",
    "check_timeout",
]

QUEUED_MOST = 2
"""Parts a worker may have outstanding at once: the one it records and one queued behind."""


@dataclass
class Part:
    """A worker's part of a rollout: what was asked, the rollout's arrays it goes into (its
    columns: ``into``), and its reply once in."""

    worker: int
    env_ids: tuple[int, ...]
    steps: int
    version: int
    check_actions: bool
    out: Out
    reply: Reply | None = None
    into: Sampled = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.into = self.out.into(self.env_ids)


class RolloutParts:
    """The parts out (by the command that carries each) and in, not yet handed over."""

    def __init__(self) -> None:
        self.out: dict[Sample, Part] = {}
        self.done: list[Part] = []

    def __bool__(self) -> bool:
        return bool(self.out or self.done)

    def outstanding(self) -> list[Part]:
        """Every part out or in, not yet handed over."""
        return [*self.out.values(), *self.done]

    def per_worker(self) -> Counter[int]:
        """How many parts each worker has outstanding."""
        return Counter(p.worker for p in self.outstanding())

    def pending_envs(self) -> set[int]:
        """The envs whose part of a rollout is out (or in, not yet handed over)."""
        return {i for part in self.outstanding() for i in part.env_ids}

    def owed(self) -> int:
        """The envs whose next part is out or in: each worker's block once."""
        return sum({p.worker: len(p.env_ids) for p in self.outstanding()}.values())

    def ready(self) -> list[Part]:
        """The parts a hand-over takes: each worker's first part in."""
        first: dict[int, Part] = {}
        for part in self.done:
            first.setdefault(part.worker, part)
        return list(first.values())

    def handed_over(self, parts: list[Part]) -> None:
        """``parts`` (of :meth:`ready`) are handed over."""
        gone = {id(p) for p in parts}
        self.done = [p for p in self.done if id(p) not in gone]


def check_min_envs(min_envs: Any, owed: int) -> int:
    """``rollout_wait``'s ``min_envs``, at most the envs owed."""
    if isinstance(min_envs, bool) or not isinstance(min_envs, int | np.integer) or min_envs < 1:
        raise ValueError(f"min_envs must be an int >= 1 or None, got {min_envs!r}")
    return min(int(min_envs), owed)


def check_max_lag(max_lag: Any) -> int | None:
    """``rollout_wait``'s ``max_lag``."""
    if max_lag is not None and (
        isinstance(max_lag, bool) or not isinstance(max_lag, int | np.integer) or max_lag < 0
    ):
        raise ValueError(f"max_lag must be an int >= 0 or None, got {max_lag!r}")
    return None if max_lag is None else int(max_lag)


def check_timeout(timeout: Any) -> float:
    """``rollout_wait``'s ``timeout``."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValueError(f"timeout must be seconds >= 0 or None, got {timeout!r}")
    return float(timeout)
