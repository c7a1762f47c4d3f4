"""Environments and workloads shared by the benchmarks.

Everything here is defined at module level so that worker processes (fork, forkserver or spawn)
can import it by reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces


class SleepEnv(gymnasium.Env[np.ndarray, int]):
    """An env whose ``step`` sleeps (1 ms by default): the stand-in for a simulator that waits.

    Observations are ``Box(-inf, inf, (4,), float32)``, actions ``Discrete(2)``; every episode is
    truncated after ``max_steps`` steps with reward 1 per step.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, sleep_s: float = 0.001, max_steps: int = 200) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.sleep_s = sleep_s
        self.max_steps = max_steps
        self._t = 0
        self._obs = np.zeros(4, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        self._obs[:] = 0.0
        return self._obs.copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.sleep_s)
        self._t += 1
        self._obs[0] = self._t
        self._obs[1] = action
        return self._obs.copy(), 1.0, False, self._t >= self.max_steps, {}


class NoOpEnv(gymnasium.Env[np.ndarray, int]):
    """An env whose ``step`` does nothing: a constant observation, never done (the fixed cost
    of a step is all that is left to measure)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._obs = np.zeros(4, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self._obs, 0.0, False, False, {}


EnvRef = str | type[gymnasium.Env[Any, Any]]
"""A registered Gymnasium id or an env class (both picklable by reference)."""


@dataclass(frozen=True)
class Target:
    """A throughput case with a bar to clear: which env, how many copies, and the least ratio
    of envfleet process to the independent-processes ceiling (the engine's
    :class:`envfleet.benchmark.Workload` is the env and count alone).

    Attributes:
        name: short name used on the command line (``cartpole``).
        env: registered id or env class.
        num_envs: number of envs stepped together.
        target: minimum envfleet-process / independent-processes-ceiling ratio, if any.
    """

    name: str
    env: EnvRef
    num_envs: int
    target: float | None = None


TARGETS: dict[str, Target] = {
    "cartpole": Target("cartpole", "CartPole-v1", 64, target=0.7),
    "pong": Target("pong", "ALE/Pong-v5", 8, target=0.85),
    "sleep": Target("sleep", SleepEnv, 32),
}
