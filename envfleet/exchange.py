"""The exchange: a pool's actions out and results in, EnvPool style.

The face (:class:`~envfleet.Pool`) hands it what the caller gave ``reset``, ``step``, ``send``
and ``recv``, with the face's settings of the moment (``copy``, ``check_actions``,
``batch_size``). The exchange checks that the envs addressed may take it (the pool usable, the
envs idle and reset), writes the actions into the batch, tells the dispatch what to send, and
reads the results from the batch, infos merged Gymnasium's way::

    send(actions, env ids) ── lifecycle, ledger (idle?), episodes (reset?), action check
        ──► actions written (ActionWriter) ──► dispatch.submit_step
    recv(batch_size) ◄── results read (ResultReader) ◄── dispatch.first_ready
    sync step = send of every env ──► dispatch.collect ──► results of every env, in order
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.actions import ActionWriter
from envfleet.buffers import Batch
from envfleet.dispatch import Dispatch
from envfleet.episodes import Episodes
from envfleet.errors import AlreadyPendingError, NoPendingError
from envfleet.ledger import Ledger
from envfleet.lifecycle import Lifecycle
from envfleet.protocol import Call, SetAttr
from envfleet.recovery import Recovery
from envfleet.results import ResultReader, Results
from envfleet.stats import StatsRecorder
from envfleet.validation import (
    ActionCheck,
    check_attr_values,
    check_env_ids,
    check_options,
    check_reset_mask,
)

EnvIds = Sequence[int] | np.ndarray | None
"""The envs a call addresses, as the caller gives them (``None``: every env)."""


class Exchange:
    """Sends one pool's resets and actions, and hands its results out.

    Args:
        life: the pool's lifecycle (the first check of every call).
        episodes: which envs need a reset; the pool's first seed.
        dispatch: what sends the commands and takes the replies in.
        ledger: which envs are idle, in flight and ready.
        recovery: the pool's failure policy (its ``worker_memory_limit``).
        batch: the pool's batch arrays (actions in, results out).
        stats: told which envs ended an episode.
        observation_space: the single observation space.
        action_space: the single action space.
    """

    def __init__(
        self,
        life: Lifecycle,
        episodes: Episodes,
        dispatch: Dispatch,
        ledger: Ledger,
        recovery: Recovery,
        batch: Batch,
        stats: StatsRecorder,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
    ) -> None:
        self._life = life
        self._episodes = episodes
        self._dispatch = dispatch
        self._ledger = ledger
        self._recovery = recovery
        self._num_envs = num_envs = ledger.num_envs
        self._all_ids = all_ids = ledger.all_ids
        self._check_actions = ActionCheck(action_space, num_envs)
        self._actions = ActionWriter(
            action_space, batch.actions, all_ids, ledger.worker_of, ledger.num_workers
        )
        self._read = ResultReader(batch, observation_space, ledger, stats, episodes.needs_reset)

    # -- resets --------------------------------------------------------------------------------

    def reset(
        self, seed: int | Sequence[int | None] | None, options: dict[str, Any] | None, copy: bool
    ) -> tuple[Any, dict[str, Any]]:
        """``Pool.reset``: every env (or those of ``options["reset_mask"]``), waited for."""
        self._life.check()
        options = check_options(options)
        n = self._num_envs
        env_ids = np.arange(n)
        if options is not None and "reset_mask" in options:
            env_ids = np.flatnonzero(check_reset_mask(options.pop("reset_mask"), n))
        busy = self._ledger.busy(self._all_ids)
        if busy.size:
            raise AlreadyPendingError(
                f"reset() needs every env idle, but envs {busy.tolist()} have results pending; "
                "recv() them first (or use async_reset(env_id=...))"
            )
        seeds = self._episodes.seeds(seed, env_ids, per_env=n)
        self._submit_reset(env_ids, seeds, options)
        self._dispatch.collect(env_ids)
        self._episodes.needs_reset[env_ids] = False
        infos = self._read.infos(env_ids, positions=env_ids, size=n)
        return self._read.observations(None, copy), infos

    def async_reset(
        self,
        seed: int | Sequence[int | None] | None,
        options: dict[str, Any] | None,
        env_id: EnvIds,
    ) -> None:
        """``Pool.async_reset``: start resetting envs ``env_id`` (default all), each idle."""
        self._life.check()
        options = check_options(options)
        env_ids = self._idle_ids(env_id, "async_reset")
        seeds = self._episodes.seeds(seed, env_ids, per_env=len(env_ids))
        self._submit_reset(env_ids, seeds, options)

    def _submit_reset(
        self, env_ids: np.ndarray, seeds: list[int | None], options: dict[str, Any] | None
    ) -> None:
        self._dispatch.submit_reset(env_ids, seeds, options)
        self._episodes.reset_sent(env_ids)

    # -- steps ---------------------------------------------------------------------------------

    def step(
        self, actions: Any, env_id: EnvIds, batch_size: int, copy: bool, check: bool
    ) -> Results:
        """``Pool.step``: the sync step, or a send of ``env_id`` then a recv."""
        if env_id is None and batch_size == self._num_envs:
            return self.step_all(actions, copy, check)
        if env_id is not None:  # refused before sending if recv() could not complete it
            self.check_batch(env_id, batch_size)
        self.send(actions, env_id, check)
        return self.recv(batch_size, copy)

    def step_all(self, actions: Any, copy: bool, check: bool) -> Results:
        """The sync step: every env stepped with ``actions``, its results in env order."""
        spares = self._dispatch.spares if copy else None
        try:  # with spares, the workers copy the observations into one, handed out as is
            self.send(actions, None, check, spare=spares is not None)
            self._dispatch.collect(self._all_ids)
            return self._read.results(self._all_ids, copy=spares or copy)
        finally:
            if spares is not None:
                spares.disarm()

    def check_batch(self, env_id: EnvIds, batch_size: int) -> None:
        """Raise unless a send to ``env_id`` leaves ``batch_size`` envs for the ``recv`` of
        ``step(actions, env_id)``: a send that recv() cannot complete left its envs pending."""
        self._life.check()
        sent = len(check_env_ids(env_id, self._num_envs))
        owed = self._ledger.owed()
        if owed + sent < batch_size:
            raise NoPendingError(
                f"step(env_id=...) of {sent} envs returns batch_size={batch_size} envs, "
                f"but only {owed + sent} would be pending; send more envs (or use send())"
            )

    def send(self, actions: Any, env_id: EnvIds, check: bool, spare: bool = False) -> None:
        """``Pool.send``: one action to each env of ``env_id`` (default all), each idle and
        reset; ``check``: each action against the action space. ``spare``: see
        :meth:`Dispatch.submit_step`."""
        self._life.check()
        env_ids = self._idle_ids(env_id, "send")
        self._episodes.check_step(env_ids)
        actions = self._check_actions(actions, env_ids, check)
        if self._recovery.worker_memory_limit is not None:
            self._dispatch.recycle_over_limit()
        self._dispatch.submit_step(env_ids, self._actions.write(actions, env_ids), spare)

    def recv(self, batch_size: int, copy: bool) -> Results:
        """``Pool.recv``: the results of the first ``batch_size`` envs ready."""
        self._life.check()
        owed = self._ledger.owed()
        if owed < batch_size:
            raise NoPendingError(
                f"recv() returns batch_size={batch_size} envs but only {owed} have a step "
                "or reset pending; send() actions (or async_reset()) first"
            )
        env_ids = self._dispatch.first_ready(batch_size)
        if batch_size == self._num_envs:
            env_ids.sort()
        return self.results(env_ids, copy)

    def wait_all(self, copy: bool) -> Results:
        """The results of every env, in order, once all are in (``step_wait``)."""
        self._dispatch.collect(self._all_ids)
        return self._read.results(self._all_ids, with_env_id=False, copy=copy)

    def results(self, env_ids: np.ndarray, copy: bool) -> Results:
        """The results of ready ``env_ids`` as ``recv`` returns them (``infos["env_id"]``)."""
        return self._read.results(env_ids, with_env_id=True, copy=copy)

    # -- calls ---------------------------------------------------------------------------------

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``Pool.call``: method ``name`` of every env called (or attribute read)."""
        commands = [Call(name, args, kwargs) for _ in self._ledger.assignment]
        self._life.check()
        return self._dispatch.call(commands)

    def set_attr(self, name: str, values: Any) -> None:
        """``Pool.set_attr``: attribute ``name`` of every env set."""
        values = check_attr_values(name, values, self._num_envs)
        commands = [SetAttr(name, {i: values[i] for i in ids}) for ids in self._ledger.assignment]
        self._life.check()
        self._dispatch.call(commands)

    def _idle_ids(self, env_id: EnvIds, what: str) -> np.ndarray:
        if env_id is None and self._ledger.all_idle():  # every env idle: the sync step
            return self._all_ids
        env_ids = check_env_ids(env_id, self._num_envs)
        busy = self._ledger.busy(env_ids)
        if busy.size:
            raise AlreadyPendingError(
                f"{what}: envs {busy.tolist()} already have a step or result pending; "
                "recv() their results first"
            )
        return env_ids


__all__ = ["Exchange"]
