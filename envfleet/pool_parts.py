"""The pool's parts, wired once: what :class:`~envfleet.Pool` (the face) holds.

::

    Pool ── ledger (per-env state), recovery (what failures mean), dispatch (the one speaker
            to the workers), lifecycle (open, closed, broken), exchange (steps, resets, calls),
            gymnasium (the *_async/*_wait calls), rollouts (sync and async), report (stats)

Each part gets, by its constructor, only the parts it needs; the face keeps the settings a
caller may change and hands them over with each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envfleet.backends import Transport
from envfleet.dispatch import Dispatch
from envfleet.episodes import Episodes
from envfleet.exchange import Exchange
from envfleet.gymnasium_async import GymnasiumAsync
from envfleet.ledger import Ledger
from envfleet.lifecycle import Lifecycle
from envfleet.pool_rollouts import PoolRollouts
from envfleet.recovery import Recovery
from envfleet.report import Report
from envfleet.stats import StatsRecorder


@dataclass(frozen=True)
class Parts:
    """One pool's parts."""

    ledger: Ledger
    recovery: Recovery
    dispatch: Dispatch
    life: Lifecycle
    exchange: Exchange
    gymnasium: GymnasiumAsync
    rollouts: PoolRollouts
    report: Report

    @classmethod
    def wire(
        cls,
        face: Any,
        transport: Transport,
        assignment: Sequence[tuple[int, ...]],
        env_name: str,
        seed: int | None,
        recovery_settings: dict[str, Any],
    ) -> Parts:
        """The parts of ``face`` (a :class:`~envfleet.Pool`, its spaces and modes set) over
        ``transport``; ``recovery_settings``: :class:`Recovery`'s keyword arguments."""
        num_envs = sum(len(ids) for ids in assignment)
        stats = StatsRecorder([tuple(ids) for ids in assignment], num_envs)
        ledger = Ledger(assignment, stats, transport.batch.infos.put)
        recovery = Recovery(ledger, env_name=env_name, **recovery_settings)
        dispatch = Dispatch(transport, ledger, recovery, env_name, face._gather)
        life = Lifecycle(env_name, dispatch, recovery)
        episodes = Episodes(num_envs, face.autoreset_mode, seed)
        spaces = face.single_observation_space, face.single_action_space
        parts = life, episodes, dispatch, ledger, recovery, transport.batch, stats
        exchange = Exchange(*parts, *spaces)
        gymnasium = GymnasiumAsync(face, life, episodes, exchange)
        rollouts = PoolRollouts(*parts, *spaces)
        report = Report(stats, ledger, recovery, dispatch)
        return cls(ledger, recovery, dispatch, life, exchange, gymnasium, rollouts, report)


__all__ = ["Parts"]
