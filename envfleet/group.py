"""EnvGroup: the one stepping loop, shared by every backend.

A group owns a few envs of the pool (global indices) and the batch arrays it writes into:
shared-memory views in a worker process, the pool's own arrays in the serial and thread
backends. It applies the autoreset mode and catches each env's exceptions as
:class:`~envfleet.protocol.EnvFailure` records, so one env's crash never stops the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.buffers import Batch, make_reader, make_writer
from envfleet.errors import Phase
from envfleet.protocol import EnvFailure, Reply
from envfleet.spec import EnvSpec


class GroupStartError(Exception):
    """Building an env of the group failed; carries the failure record."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class EnvGroup:
    """Several envs stepped one after another, writing rows of shared batch arrays.

    Args:
        spec: how to build each env.
        env_ids: global indices of the envs this group owns.
        batch: arrays of the whole pool; the group writes only its own rows.
        autoreset_mode: Gymnasium's autoreset semantics to apply.
        observation_space: the pool's single observation space (each env must match it).
        action_space: the pool's single action space (each env must match it).
        ship_observations: send observations back in each reply (pickled path) instead of
            relying on the parent to see the batch arrays.
    """

    def __init__(
        self,
        spec: EnvSpec,
        env_ids: Sequence[int],
        batch: Batch,
        autoreset_mode: AutoresetMode,
        observation_space: gymnasium.Space[Any],
        action_space: gymnasium.Space[Any],
        ship_observations: bool = False,
    ) -> None:
        self.env_ids = tuple(env_ids)
        self.batch = batch
        self.mode = autoreset_mode
        self.ship_observations = ship_observations
        self.envs: dict[int, gymnasium.Env[Any, Any]] = {}
        self._needs_reset = dict.fromkeys(self.env_ids, False)
        self._write_obs = make_writer(observation_space, batch.observations)
        self._write_action = make_writer(action_space, batch.actions)
        self._read_action = make_reader(action_space, batch.actions)
        for i in self.env_ids:
            try:
                env = spec.build()
                if env.observation_space != observation_space or env.action_space != action_space:
                    raise ValueError(
                        f"env {i} has observation space {env.observation_space} and action "
                        f"space {env.action_space}, expected {observation_space} and "
                        f"{action_space} (every env of a pool must share its spaces)"
                    )
            except Exception as exc:
                self.close()
                raise GroupStartError(EnvFailure.capture(i, Phase.MAKE, exc)) from exc
            self.envs[i] = env

    def reset(
        self,
        env_ids: Sequence[int],
        seeds: Sequence[int | None],
        options: dict[str, Any] | None,
    ) -> Reply:
        """Reset ``env_ids``, writing their first observations."""
        batch, infos, failures = self.batch, {}, []
        for i, seed in zip(env_ids, seeds, strict=True):
            try:
                obs, info = self.envs[i].reset(seed=seed, options=options)
            except Exception as exc:
                failures.append(EnvFailure.capture(i, Phase.RESET, exc))
                continue
            self._write_obs(i, obs)
            batch.terminations[i] = batch.truncations[i] = False
            self._needs_reset[i] = False
            if info:
                infos[i] = info
        return self._reply(env_ids, infos, failures)

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        """Step ``env_ids`` with the actions in their batch rows, applying autoreset."""
        if actions is not None:
            for i, action in actions.items():
                self._write_action(i, action)
        batch, infos, failures = self.batch, {}, []
        rewards, terms, truncs = batch.rewards, batch.terminations, batch.truncations
        envs, needs_reset, read_action, write_obs = (
            self.envs,
            self._needs_reset,
            self._read_action,
            self._write_obs,
        )
        next_step = self.mode is AutoresetMode.NEXT_STEP
        same_step = self.mode is AutoresetMode.SAME_STEP
        for i in env_ids:
            env = envs[i]
            try:
                if next_step and needs_reset[i]:
                    obs, info = env.reset()
                    reward, terminated, truncated = 0.0, False, False
                else:
                    obs, reward, terminated, truncated, info = env.step(read_action(i))
                    if same_step and (terminated or truncated):
                        final = {"final_obs": obs, "final_info": info}
                        obs, info = env.reset()
                        info = {**final, **info}
            except Exception as exc:
                failures.append(EnvFailure.capture(i, Phase.STEP, exc))
                continue
            write_obs(i, obs)
            rewards[i] = reward
            terms[i] = terminated
            truncs[i] = truncated
            needs_reset[i] = terminated or truncated
            if info:
                infos[i] = info
        return self._reply(env_ids, infos, failures)

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """Call ``name`` on each env (or read it, when it is not callable)."""
        values, failures = {}, []
        for i, env in self.envs.items():
            try:
                attr = env.get_wrapper_attr(name)
                values[i] = attr(*args, **kwargs) if callable(attr) else attr
            except Exception as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(values=values, failures=tuple(failures))

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        """Set attribute ``name`` of each env to its value."""
        failures = []
        for i, value in values.items():
            try:
                self.envs[i].set_wrapper_attr(name, value)
            except Exception as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(failures=tuple(failures))

    def close(self) -> Reply:
        """Close every env, reporting (not raising) what fails."""
        failures = []
        for i, env in self.envs.items():
            try:
                env.close()
            except Exception as exc:
                failures.append(EnvFailure.capture(i, Phase.CLOSE, exc))
        self.envs.clear()
        return Reply(failures=tuple(failures))

    def _reply(
        self, env_ids: Sequence[int], infos: dict[int, Any], failures: list[EnvFailure]
    ) -> Reply:
        observations = None
        if self.ship_observations:
            observations = {i: self.batch.observations[i] for i in env_ids}
        return Reply(
            env_ids=tuple(env_ids),
            infos=infos or None,
            observations=observations,
            failures=tuple(failures),
        )
