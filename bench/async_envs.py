"""The heavy-tailed env of ``bench/async_bench.py``.

Everything is defined at module level so that worker processes (fork, forkserver or spawn) can
import it by reference.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces

FAST_S = 0.0002
SLOW_S = 0.005
SLOW_P = 0.1


class HeavyTailEnv(gymnasium.Env[np.ndarray, int]):
    """An env whose ``step`` sleeps ``fast_s`` (90%) or ``slow_s`` (10%): a heavy tail.

    Which steps are slow is drawn from the env's own RNG (``self.np_random``), seeded by the
    ``seed`` of its first reset, so that a seeded run sleeps the same sequence every time,
    whatever backend steps it. Observations are ``Box(-inf, inf, (4,), float32)``: the step
    count, the action, the last sleep (ms) and 0. Episodes are truncated after ``max_steps``.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        fast_s: float = FAST_S,
        slow_s: float = SLOW_S,
        slow_p: float = SLOW_P,
        max_steps: int = 500,
    ) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.fast_s, self.slow_s, self.slow_p = fast_s, slow_s, slow_p
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
        sleep = self.slow_s if self.np_random.random() < self.slow_p else self.fast_s
        time.sleep(sleep)
        self._t += 1
        self._obs[0] = self._t
        self._obs[1] = action
        self._obs[2] = sleep * 1e3
        return self._obs.copy(), 1.0, False, self._t >= self.max_steps, {}


def expected_step_s(
    fast_s: float = FAST_S, slow_s: float = SLOW_S, slow_p: float = SLOW_P
) -> float:
    """Mean requested sleep of a :class:`HeavyTailEnv` step (``time.sleep`` oversleeps this)."""
    return (1 - slow_p) * fast_s + slow_p * slow_s
