"""EnvGroup: the one stepping loop, shared by every backend.

A group owns a few envs of the pool (global indices) and the batch arrays it writes into:
shared-memory views in a worker process, the pool's own arrays in the serial and thread
backends. It applies the autoreset mode and catches each env's exceptions as
:class:`~envfleet.protocol.EnvFailure` records, so one env's crash never stops the others.

Under ``on_error="restart"`` a failed env is rebuilt here, at once, and its interrupted episode
is reported as truncated (reward 0, ``infos["envfleet/restarted"]``); the fresh env is reset
with a seed derived from the pool seed, the env index and its restart count. Building,
rebuilding, calling and closing the envs themselves is :mod:`envfleet.group_envs`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.batch_rows import BatchRows
from envfleet.buffers import Batch
from envfleet.errors import OnError, Phase
from envfleet.group_envs import RESTARTED, GroupEnvs, GroupStartError, derive_seed
from envfleet.guards import env_errors
from envfleet.protocol import EnvFailure, Reply
from envfleet.row_access import make_reader, make_writer
from envfleet.spec import EnvSpec

__all__ = ["BATCHED_MIN_ENVS", "RESTARTED", "EnvGroup", "GroupStartError", "derive_seed"]

BATCHED_MIN_ENVS = 6
"""Groups stepping at least this many envs write their results with one assignment per field;
smaller ones env by env, which costs less below it (numpy's fixed cost per assignment;
by ``bench/group_cost.py``, a probe now in the git history: 3.5 against 3.8 µs a step at 4,
6.1 against 4.9 at 8)."""


class EnvGroup:
    """Several envs stepped one after another, writing rows of shared batch arrays.

    Args:
        spec: how to build each env.
        env_ids: global indices of the envs this group owns.
        batch: arrays of the whole pool; the group writes only its own rows.
        autoreset_mode: Gymnasium's autoreset semantics to apply.
        observation_space: the pool's single observation space (each env must match it).
        action_space: the pool's single action space (each env must match it).
        on_error: rebuild a failed env in place (``RESTART``) or report it (``RAISE``).
        seed_base: the pool's seed, from which restarted envs' seeds derive.
        restarts: restarts so far per env (a restarted worker continues the count).
        restarted: this group replaces a worker that died: every env starts restarted.
        rebuild_timeout, rebuild_thread_timeout: the bound on the rebuild of a failed env,
            in a worker process or in a worker thread
            (:class:`~envfleet.group_envs.GroupEnvs`).
    """

    def __init__(
        self,
        spec: EnvSpec,
        env_ids: Sequence[int],
        batch: Batch,
        autoreset_mode: AutoresetMode,
        observation_space: gymnasium.Space[Any],
        action_space: gymnasium.Space[Any],
        on_error: OnError = OnError.RAISE,
        seed_base: int | None = None,
        restarts: Mapping[int, int] | None = None,
        restarted: bool = False,
        rebuild_timeout: float | None = None,
        rebuild_thread_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        self.env_ids = tuple(env_ids)
        self.batch = batch
        self.mode = autoreset_mode
        self.on_error = on_error
        self.seed_base = seed_base
        self.observation_space = observation_space
        self.action_space = action_space
        self._owe_reset: set[int] = set()  # envs whose episode ended (NEXT_STEP: reset next)
        self._write_obs = make_writer(observation_space, batch.observations)
        self._read_obs = make_reader(observation_space, batch.observations)
        self._read_action = make_reader(action_space, batch.actions)
        # The batched step (one assignment per field): actions in one array, and autoreset
        # modes that keep one result per env; SAME_STEP steps env by env.
        self._batched = (
            isinstance(batch.actions, np.ndarray) and autoreset_mode is not AutoresetMode.SAME_STEP
        )
        self._rows: BatchRows | None = None  # those of the command repeated every step
        self._members = GroupEnvs(
            spec,
            self.env_ids,
            observation_space,
            action_space,
            seed_base,
            restarts,
            restarted,
            rebuild_timeout,
            rebuild_thread_timeout,
        )

    @property
    def envs(self) -> dict[int, gymnasium.Env[Any, Any]]:
        """The group's envs by global index."""
        return self._members.envs

    @property
    def restarts(self) -> dict[int, int]:
        """Restarts so far per env."""
        return self._members.restarts

    def reset(
        self,
        env_ids: Sequence[int],
        seeds: Sequence[int | None],
        options: dict[str, Any] | None,
    ) -> Reply:
        """Reset ``env_ids``, writing their first observations."""
        batch, members = self.batch, self._members
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        for i, seed in zip(env_ids, seeds, strict=True):
            if seed is None:
                seed = members.reset_seed.pop(i, None)
            restarted = i in members.truncate_next
            members.truncate_next.discard(i)
            try:
                obs, info = self.envs[i].reset(seed=seed, options=options)
                self._write_obs(i, obs)
            except env_errors() as exc:
                failure = EnvFailure.capture(i, Phase.RESET, exc)
                if self.on_error is OnError.RAISE or not self._restart(i, failure, failures):
                    failures.append(failure)
                    continue
                try:
                    obs, info = self.envs[i].reset(seed=members.reset_seed.pop(i), options=options)
                    self._write_obs(i, obs)
                except env_errors() as exc2:
                    failures.append(EnvFailure.capture(i, Phase.RESET, exc2))
                    continue
                members.truncate_next.discard(i)
                restarted = True
            batch.terminations[i] = batch.truncations[i] = False
            self._owe_reset.discard(i)
            if restarted:
                info = {**info, RESTARTED: True}
            if info:
                infos[i] = info
        return self._reply(env_ids, infos, failures)

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        """Step ``env_ids`` with the actions in their batch rows, applying autoreset."""
        if (
            actions is None
            and self._batched
            and not self._members.truncate_next
            and len(env_ids) >= BATCHED_MIN_ENVS
        ):
            return self._step_batched(env_ids)
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        kept: list[int] = []
        self._step_each(env_ids, actions, infos, failures, kept)
        return self._reply(env_ids, infos, failures, kept)

    def _step_batched(self, env_ids: Sequence[int]) -> Reply:
        """The hot path: every env's result is collected first, then written with one
        assignment per field (:class:`BatchRows`), as ``SyncVectorEnv`` does; nothing is done
        per env beyond its ``step`` (issue 23). The first env that raises hands the rest to
        :meth:`_step_each`."""
        rows = self._rows
        if rows is None or env_ids is not rows.env_ids:
            rows = self._rows_of(env_ids)
        owe = self._owe_reset
        results: list[Any] = []
        append = results.append
        reset_ids: list[int] = []
        try:
            # zip without strict: one entry per env by construction, and the check costs more
            # than the rest of a small group's step.
            actions = rows.action_view
            if actions is None:
                actions = rows.actions()
            if owe and self.mode is AutoresetMode.NEXT_STEP:
                for i, env, action in zip(env_ids, rows.envs, actions):  # noqa: B905
                    if i in owe:
                        reset_ids.append(i)
                        obs, info = env.reset(seed=self._members.reset_seed.pop(i, None))
                        append((obs, 0.0, False, False, info))
                    else:
                        append(env.step(action))
            else:
                for env, action in zip(rows.envs, actions):  # noqa: B905
                    append(env.step(action))
        except env_errors() as exc:
            return self._step_failed(env_ids, results, reset_ids, exc)
        infos: dict[int, Any] = {}
        if not rows.write_and_book(results, self._write_obs, reset_ids, self._owe_reset, infos):
            failures: list[EnvFailure] = []
            kept: list[int] = []
            self._write_each(env_ids, results, infos, failures, kept)
            return self._reply(env_ids, infos, failures, kept)
        if self._members.log:
            return self._reply(env_ids, infos, [])
        return Reply(env_ids=tuple(env_ids), infos=infos or None)

    def _step_failed(
        self, env_ids: Sequence[int], results: list[Any], reset_ids: list[int], exc: BaseException
    ) -> Reply:
        """Env ``env_ids[len(results)]`` raised ``exc``: write the results before it, report
        (or restart) it, and step the rest one env at a time."""
        k = len(results)
        if reset_ids and reset_ids[-1] == env_ids[k]:
            reset_ids.pop()
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        kept: list[int] = []
        done = env_ids[:k]
        rows = BatchRows(self.batch, done, [self.envs[i] for i in done])
        if not rows.write_and_book(results, self._write_obs, reset_ids, self._owe_reset, infos):
            self._write_each(done, results, infos, failures, kept)
        self._failed(env_ids[k], exc, infos, failures, kept)
        self._step_each(env_ids[k + 1 :], None, infos, failures, kept)
        return self._reply(env_ids, infos, failures, kept)

    def _write_each(
        self,
        env_ids: Sequence[int],
        results: list[Any],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Results written one env at a time, as :meth:`_step_each` does (the slow path)."""
        self._flags_written()
        batch, owe = self.batch, self._owe_reset
        for i, result in zip(env_ids, results, strict=True):
            try:
                obs, reward, terminated, truncated, info = result
                self._write_obs(i, obs)
            except env_errors() as exc:
                self._failed(i, exc, infos, failures, kept)
                continue
            batch.rewards[i] = reward
            batch.terminations[i] = terminated
            batch.truncations[i] = truncated
            if terminated or truncated:
                owe.add(i)
            else:
                owe.discard(i)
            if info:
                infos[i] = info

    def _step_each(
        self,
        env_ids: Sequence[int],
        actions: dict[int, Any] | None,
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Step ``env_ids`` one env at a time (carried actions, restarts, ``SAME_STEP``)."""
        self._flags_written()
        batch = self.batch
        rewards, terms, truncs = batch.rewards, batch.terminations, batch.truncations
        # Carried actions (another dtype than the batch arrays', or no shared arrays) reach the
        # env as the caller gave them, never cast into the batch first.
        read_action = self._read_action if actions is None else actions.__getitem__
        envs, owe, write_obs = self.envs, self._owe_reset, self._write_obs
        next_step = self.mode is AutoresetMode.NEXT_STEP
        same_step = self.mode is AutoresetMode.SAME_STEP
        truncate_next, reset_seed = self._members.truncate_next, self._members.reset_seed
        for i in env_ids:
            if truncate_next and i in truncate_next:
                self._truncate(i, infos, failures, kept)
                continue
            env = envs[i]
            reward: Any
            try:
                if next_step and i in owe:
                    obs, info = env.reset(seed=reset_seed.pop(i, None))
                    reward, terminated, truncated = 0.0, False, False
                else:
                    obs, reward, terminated, truncated, info = env.step(read_action(i))
                    if same_step and (terminated or truncated):
                        final = {"final_obs": obs, "final_info": info}
                        obs, info = env.reset(seed=reset_seed.pop(i, None))
                        info = {**final, **info}
                write_obs(i, obs)
            except env_errors() as exc:
                self._failed(i, exc, infos, failures, kept)
                continue
            rewards[i] = reward
            terms[i] = terminated
            truncs[i] = truncated
            if terminated or truncated:
                owe.add(i)
            else:
                owe.discard(i)
            if info:
                infos[i] = info

    def _failed(
        self,
        i: int,
        exc: BaseException,
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Env ``i`` raised ``exc`` stepping: report it, or restart it and truncate its episode."""
        failure = EnvFailure.capture(i, Phase.STEP, exc)
        if self.on_error is OnError.RAISE or not self._restart(i, failure, failures):
            failures.append(failure)
        else:
            self._truncate(i, infos, failures, kept)

    def _flags_written(self) -> None:
        """Flags are about to be written env by env: the kept rows no longer know theirs."""
        if self._rows is not None:
            self._rows.flags_clear = False

    def _rows_of(self, env_ids: Sequence[int]) -> BatchRows:
        """The batch rows of ``env_ids`` and their envs, kept for the command repeated every
        step (a tuple, the same object each time)."""
        rows = BatchRows(self.batch, env_ids, [self.envs[i] for i in env_ids])
        if isinstance(env_ids, tuple):
            self._rows = rows
        return rows

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """Call ``name`` on each env (or read it, when it is not callable)."""
        return self._members.call(name, args, kwargs)

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        """Set attribute ``name`` of each env to its value."""
        return self._members.set_attr(name, values)

    def close(self) -> Reply:
        """Close every env, reporting (not raising) what fails."""
        self._rows = None
        return self._members.close()

    # -- restarts ----------------------------------------------------------------------------

    def _restart(self, i: int, failure: EnvFailure, failures: list[EnvFailure]) -> bool:
        """Replace env ``i`` by a fresh one; False (and a failure recorded) if that fails."""
        self._rows = None  # the env list it keeps holds the env replaced here
        return self._members.restart(i, failure, failures)

    def _truncate(
        self, i: int, infos: dict[int, Any], failures: list[EnvFailure], kept: list[int]
    ) -> None:
        """Report the interrupted episode of restarted env ``i`` as truncated."""
        self._flags_written()
        self._members.truncate_next.discard(i)
        info: dict[str, Any] = {RESTARTED: True}
        if self.mode is AutoresetMode.SAME_STEP:
            final_obs = copy.deepcopy(self._read_obs(i))
            try:
                obs, reset_info = self.envs[i].reset(seed=self._members.reset_seed.pop(i, None))
                self._write_obs(i, obs)
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.RESET, exc))
                return
            info = {"final_obs": final_obs, "final_info": {}, **reset_info, **info}
            self._owe_reset.discard(i)
        else:
            # The latest observation stands (the last delivered, or, when a worker died after this
            # env had stepped, what that step produced); the next step or reset starts anew.
            kept.append(i)
            self._owe_reset.add(i)
        self.batch.rewards[i] = 0.0
        self.batch.terminations[i] = False
        self.batch.truncations[i] = True
        infos[i] = info

    def _reply(
        self,
        env_ids: Sequence[int],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: Sequence[int] = (),
    ) -> Reply:
        restarts = self._members.take_log()
        return Reply(
            env_ids=tuple(env_ids),
            infos=infos or None,
            failures=tuple(failures),
            restarts=restarts,
            kept=tuple(kept),
        )
