"""The envs of an :class:`~envfleet.group.EnvGroup`: built from their recipes with their spaces
checked, rebuilt in place after a failure, asked for attributes, and closed.

Under ``on_error="restart"`` a failed env is rebuilt here (bounded: :func:`exit_if_longer` in a
worker process of its own, :func:`build_within` on a worker thread); the fresh env owes the
group a truncated result for the episode it interrupted (:attr:`GroupEnvs.truncate_next`) and is
reset with a seed derived from the pool seed, the env index and its restart count
(:func:`derive_seed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np

from envfleet.errors import Phase
from envfleet.guards import build_within, env_errors, exit_if_longer
from envfleet.protocol import EnvFailure, Reply
from envfleet.spec import EnvSpec
from envfleet.validation import same_space

__all__ = ["RESTARTED", "GroupEnvs", "GroupStartError", "derive_seed"]

RESTARTED = "envfleet/restarted"
"""Info key set on the result that reports an env's restart."""


def derive_seed(seed_base: int | None, env_index: int, restarts: int) -> int | None:
    """The seed a restarted env is reset with: deterministic when the pool is seeded."""
    if seed_base is None:
        return None
    return int(np.random.SeedSequence([seed_base, env_index, restarts]).generate_state(1)[0])


class GroupStartError(Exception):
    """Building an env of the group failed; carries the failure record."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class GroupEnvs:
    """The envs ``env_ids`` built from ``spec``, each with ``observation_space`` and
    ``action_space``, and what their restarts leave owed (see :class:`~envfleet.group.EnvGroup`
    for the other arguments).

    Args:
        rebuild_timeout: in a worker process of its own (never the caller's): seconds the
            rebuild of a failed env may take (``start_timeout``) before the process ends itself
            (:func:`exit_if_longer`), so that the pool sees a dead worker instead of waiting
            for ever; ``None``: not bounded here.
        rebuild_thread_timeout: in a worker thread of the caller's process (the thread
            backend): seconds the rebuild of a failed env may take (``start_timeout``); it
            runs on a helper thread, abandoned past it, and the env fails (phase ``make``).

    Raises:
        GroupStartError: an env could not be built (those built before it are closed).
    """

    def __init__(
        self,
        spec: EnvSpec,
        env_ids: Sequence[int],
        observation_space: gymnasium.Space[Any],
        action_space: gymnasium.Space[Any],
        seed_base: int | None = None,
        restarts: Mapping[int, int] | None = None,
        restarted: bool = False,
        rebuild_timeout: float | None = None,
        rebuild_thread_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        self.observation_space = observation_space
        self.action_space = action_space
        self.seed_base = seed_base
        self.rebuild_timeout = rebuild_timeout
        self.rebuild_thread_timeout = rebuild_thread_timeout
        self.restarts = {i: (restarts or {}).get(i, 0) for i in env_ids}
        self.envs: dict[int, gymnasium.Env[Any, Any]] = {}
        self.truncate_next: set[int] = set()  # restarted envs owing a truncated result
        self.reset_seed: dict[int, int | None] = {}  # seeds for restarted envs' next reset
        self.log: list[EnvFailure] = []  # the failures restarted since the last reply
        for i in env_ids:
            try:
                self.envs[i] = self.build(i)
            except env_errors() as exc:
                self.close()
                raise GroupStartError(EnvFailure.capture(i, Phase.MAKE, exc)) from exc
            if restarted:
                self.owe_truncation(i)

    def build(self, i: int) -> gymnasium.Env[Any, Any]:
        """Build env ``i`` with its own recipe (``env_fns[i]``) and check its spaces."""
        spec = self.spec.for_env(i)
        env = spec.build()
        for what, got, expected in (
            ("observation", env.observation_space, self.observation_space),
            ("action", env.action_space, self.action_space),
        ):
            if not same_space(got, expected):
                env.close()
                raise ValueError(
                    f"env {i} ({spec.name}) has {what} space {got}, but env 0's is {expected}: "
                    "every env of a pool must have the same spaces (Gymnasium's vector envs "
                    "raise RuntimeError here too)"
                )
        return env

    def restart(self, i: int, failure: EnvFailure, failures: list[EnvFailure]) -> bool:
        """Replace env ``i`` by a fresh one; False (and a failure recorded) if that fails."""
        self.restarts[i] += 1
        self.log.append(failure)
        try:
            self.envs[i].close()
        except env_errors():
            pass  # the env is broken; its close may be too
        try:
            if self.rebuild_thread_timeout is not None:
                self.envs[i] = build_within(
                    self.rebuild_thread_timeout, lambda: self.build(i), _close_quietly
                )
            else:
                with exit_if_longer(self.rebuild_timeout):
                    self.envs[i] = self.build(i)
        except env_errors() as exc:
            failures.append(EnvFailure.capture(i, Phase.MAKE, exc))
            return False
        self.owe_truncation(i)
        return True

    def owe_truncation(self, i: int) -> None:
        """Env ``i`` was (re)built in place of one that failed: its next result is the
        interrupted episode's truncation, its next reset seeded from its restart count."""
        self.truncate_next.add(i)
        self.reset_seed[i] = derive_seed(self.seed_base, i, self.restarts[i])

    def take_log(self) -> tuple[EnvFailure, ...]:
        """The failures restarted since the last call, for the reply that reports them."""
        log, self.log = tuple(self.log), []
        return log

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """Call ``name`` on each env (or read it, when it is not callable)."""
        values: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        for i, env in self.envs.items():
            try:
                attr = env.get_wrapper_attr(name)
                values[i] = attr(*args, **kwargs) if callable(attr) else attr
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(values=values, failures=tuple(failures))

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        """Set attribute ``name`` of each env to its value."""
        failures: list[EnvFailure] = []
        for i, value in values.items():
            try:
                self.envs[i].set_wrapper_attr(name, value)
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(failures=tuple(failures))

    def close(self) -> Reply:
        """Close every env, reporting (not raising) what fails."""
        failures: list[EnvFailure] = []
        for i, env in self.envs.items():
            try:
                env.close()
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CLOSE, exc))
        self.envs.clear()
        return Reply(failures=tuple(failures))


def _close_quietly(env: Any) -> None:
    """Close an env built too late to be used (its rebuild was abandoned)."""
    try:
        env.close()
    except BaseException:  # a daemon thread's last act: nothing to report to
        pass
