"""A simulator of your own, registered with Gymnasium on import: ``envfleet run MySim-v0 --import
mysim`` (or ``envfleet run mysim:MySim-v0``) from this folder.

``MySim-v0`` stands for an env that waits on something each step (a remote simulator, a game
server): a point on a line moves left or right toward a goal, and each step sleeps
``latency`` seconds (default 1 ms) without holding the GIL. That makes it a fit for the thread
backend (``--backend thread``), where all the envs of a pool wait at once.

Usage, from ``examples/``::

    envfleet run MySim-v0 --import mysim --steps 2000
    envfleet run mysim:MySim-v0 --backend thread --cpu-affinity 0
    python -c "import envfleet, mysim; print(envfleet.make('MySim-v0', 4).reset(seed=0)[0])"
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class MySim(gymnasium.Env[np.ndarray, np.int64]):
    """A point at ``x`` in [-1, 1] that actions 0/1 move left/right by 0.1; reward 1 on
    reaching the goal, which ends the episode; truncated after ``max_steps``.

    Observation: ``[x, goal]`` (float32). Each step sleeps ``latency`` seconds first.
    """

    def __init__(self, latency: float = 0.001, max_steps: int = 200) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.latency = latency
        self.max_steps = max_steps
        self._x = 0.0
        self._goal = 0.5
        self._steps = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._x, self._goal], dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = 0.0
        self._goal = float(self.np_random.choice([-0.5, 0.5]))
        self._steps = 0
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.latency)  # the remote simulator's answer
        self._x = float(np.clip(self._x + (0.1 if action == 1 else -0.1), -1.0, 1.0))
        self._steps += 1
        reached = abs(self._x - self._goal) < 0.05
        return self._obs(), float(reached), reached, self._steps >= self.max_steps, {}


gymnasium.register("MySim-v0", entry_point=MySim)
