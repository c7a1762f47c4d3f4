"""The soak's env (:mod:`envfleet.benchmark.soak`): counts its own steps and fails at random,
reproducibly.

Defined at module level so that worker processes can import it by reference.
"""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

KINDS = ("raise", "exit", "hang")
"""Failure kinds: raise an exception, ``os._exit`` the worker, sleep far past the timeout."""

EXIT_CODE = 13
"""Exit code of a worker that an injected ``exit`` ended."""

# Observation columns.
ENV_INDEX = 0  # the env's index in the pool, from its last action (-1 before the first step)
POOL_STEP = 1  # the pool step id of the action that produced this result (-1 after a reset)
CALLS = 2  # step + reset calls of this env instance (1 after its first reset)
EPISODE_STEP = 3  # steps in this episode (0 after a reset)
EPISODES = 4  # resets of this env instance
OBS_SIZE = 5


class InjectedFailure(RuntimeError):
    """What an injected ``raise`` raises."""


class SoakEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    """Counts every call in its observation; fails with probability ``p_fail`` per step.

    The action is ``[env index, pool step id]`` (float64), which the env echoes in its
    observation, so that the driver can tell which step of which env each result belongs to.
    Whether a step fails, and how, is drawn from an RNG seeded by the ``seed`` of the env's reset
    (the pool's ``seed + i`` first, then the seed envfleet derives for each restart), so a seeded
    run injects the same failures every time. Each failure is logged, one line, to ``log_path``
    (appended and closed before it strikes) for the driver to reconcile.

    Args:
        p_fail: probability that a step fails.
        kinds: failure kinds to choose from, uniformly.
        hang_s: how long a ``hang`` sleeps (the pool's ``step_timeout`` should kill it first).
        max_steps: episode length (truncated).
        log_path: file to append failure lines to (``kind env pool_step pid calls``).
        work_us: microseconds of busy work per step (0: the step costs only its bookkeeping),
            to see how the cost of failures weighs against envs that cost something.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        p_fail: float = 1e-4,
        kinds: tuple[str, ...] = KINDS,
        hang_s: float = 60.0,
        max_steps: int = 1000,
        log_path: str | None = None,
        work_us: float = 0.0,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown failure kinds {sorted(unknown)}: choose from {KINDS}")
        self.observation_space = spaces.Box(-1.0, np.inf, shape=(OBS_SIZE,), dtype=np.float64)
        self.action_space = spaces.Box(0.0, 2.0**52, shape=(2,), dtype=np.float64)
        self.p_fail, self.kinds, self.hang_s = p_fail, tuple(kinds), hang_s
        self.max_steps = max_steps
        self.log_path = log_path
        self.work_s = work_us * 1e-6
        self._rng = np.random.default_rng()
        self._obs = np.full(OBS_SIZE, -1.0)
        self._obs[CALLS] = self._obs[EPISODE_STEP] = self._obs[EPISODES] = 0.0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        obs = self._obs
        obs[POOL_STEP] = -1.0
        obs[CALLS] += 1
        obs[EPISODE_STEP] = 0.0
        obs[EPISODES] += 1
        return obs.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs = self._obs
        obs[ENV_INDEX], obs[POOL_STEP] = action[0], action[1]
        if self._rng.random() < self.p_fail:  # drawn even when p_fail is 0: same cost
            self._fail(self.kinds[int(self._rng.integers(len(self.kinds)))])
        if self.work_s > 0:
            deadline = time.perf_counter() + self.work_s
            while time.perf_counter() < deadline:
                pass
        obs[CALLS] += 1
        obs[EPISODE_STEP] += 1
        return obs.copy(), 1.0, False, bool(obs[EPISODE_STEP] >= self.max_steps), {}

    def _fail(self, kind: str) -> None:
        obs = self._obs
        if self.log_path is not None:
            line = (
                f"{kind} {int(obs[ENV_INDEX])} {int(obs[POOL_STEP])} {os.getpid()} "
                f"{int(obs[CALLS])}\n"
            )
            with open(self.log_path, "a") as log:  # one short O_APPEND write: atomic
                log.write(line)
        if kind == "raise":
            raise InjectedFailure(
                f"injected failure: env {int(obs[ENV_INDEX])} at pool step {int(obs[POOL_STEP])}"
            )
        if kind == "exit":
            os._exit(EXIT_CODE)
        time.sleep(self.hang_s)


def read_log(path: str) -> list[tuple[str, int, int, int, int]]:
    """The failures a :class:`SoakEnv` logged: ``(kind, env, pool_step, pid, calls)``."""
    if not os.path.exists(path):
        return []
    events = []
    with open(path) as log:
        for line in log:
            kind, env, step, pid, calls = line.split()
            events.append((kind, int(env), int(step), int(pid), int(calls)))
    return events
