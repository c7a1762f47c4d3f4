"""Environments for the test suite: deterministic, small, with fault-injection hooks."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class DictTupleEnv(gymnasium.Env[dict[str, Any], np.ndarray]):
    """A seeded random walk with a nested Dict/Tuple observation and a Box action.

    Episodes end after a seed-dependent number of steps (terminated) or at ``max_steps``
    (truncated); infos carry an int, a float array and a nested dict so that info merging is
    exercised.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, max_steps: int = 12, render_mode: str | None = None) -> None:
        self.observation_space = spaces.Dict(
            {
                "pos": spaces.Box(-100.0, 100.0, shape=(2,), dtype=np.float32),
                "pair": spaces.Tuple(
                    (spaces.Discrete(5), spaces.MultiBinary(3)),
                ),
                "grid": spaces.MultiDiscrete([3, 4]),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.max_steps = max_steps
        self.render_mode = render_mode
        self._pos = np.zeros(2, dtype=np.float32)
        self._t = 0
        self._limit = max_steps

    def _obs(self) -> dict[str, Any]:
        rng = self.np_random
        return {
            "pos": self._pos.copy(),
            "pair": (int(rng.integers(5)), rng.integers(0, 2, size=3).astype(np.int8)),
            "grid": rng.integers([3, 4]).astype(np.int64),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(-1, 1, size=2).astype(np.float32)
        self._t = 0
        self._limit = int(self.np_random.integers(3, self.max_steps + 3))
        return self._obs(), {"start": self._pos.copy()}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._pos = np.clip(self._pos + np.asarray(action, np.float32), -100, 100)
        reward = float(-np.abs(self._pos).sum() + self.np_random.normal())
        terminated = self._t >= self._limit
        truncated = not terminated and self._t >= self.max_steps
        info: dict[str, Any] = {"t": self._t}
        if self._t % 3 == 0:
            info["extra"] = {"noise": self.np_random.normal(size=2)}
        return self._obs(), reward, terminated, truncated, info

    def render(self) -> np.ndarray:
        return np.full((4, 4, 3), self._t, dtype=np.uint8)


StepHook = Callable[["FaultyEnv", Any], Any]
"""Runs before each step; what it returns, if not ``None``, replaces the step's observation."""


class FaultyEnv(gymnasium.Env[np.ndarray, np.int64]):
    """A counter env whose ``reset``/``step``/``close`` call injectable hooks first.

    The hooks are plain functions (cloudpickled to workers), so a test can make one env raise,
    exit, segfault or hang at a chosen step: ``FaultyEnv.when(env_index, step, action)``.
    """

    metadata: dict[str, Any] = {}

    def __init__(
        self,
        step_hook: StepHook | None = None,
        reset_hook: Callable[[FaultyEnv], Any] | None = None,
        close_hook: Callable[[FaultyEnv], None] | None = None,
        episode_length: int = 5,
        call_hook: Callable[[FaultyEnv], None] | None = None,
        sleep: float = 0.0,
    ) -> None:
        self.observation_space = spaces.Box(0, 10_000, shape=(1,), dtype=np.int64)
        self.action_space = spaces.Discrete(3)
        self.step_hook, self.reset_hook, self.close_hook = step_hook, reset_hook, close_hook
        self.call_hook = call_hook
        self.episode_length = episode_length
        self.sleep = sleep
        self.count = 0
        self.seed_used: int | None = None
        self.pid = os.getpid()
        self.thread = threading.get_ident()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.seed_used = seed
        replaced = self.reset_hook(self) if self.reset_hook is not None else None
        self.count = 0 if seed is None else seed * 100
        if replaced is not None:  # a hook that makes the env return a wrong observation
            return replaced, {}
        return np.array([self.count], dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        replaced = self.step_hook(self, action) if self.step_hook is not None else None
        if self.sleep:
            time.sleep(self.sleep)
        self.count += 1
        terminated = self.count % self.episode_length == 0
        obs = np.array([self.count], dtype=np.int64) if replaced is None else replaced
        return obs, float(action), terminated, False, {}

    def poke(self) -> int:
        """A method for ``pool.call("poke")``: runs ``call_hook``, returns the step count."""
        if self.call_hook is not None:
            self.call_hook(self)
        return self.count

    def close(self) -> None:
        if self.close_hook is not None:
            self.close_hook(self)


class FramesEnv(FaultyEnv):
    """:class:`FaultyEnv` with image observations (64x64x3 uint8), drawn from its seeded
    ``np_random`` and its step count: a batch of a few is past the size that gets spare rows
    (``envfleet.backends.contract.spares``); the hooks, episodes and rewards are FaultyEnv's."""

    SHAPE = (64, 64, 3)

    def __init__(self, step_hook: StepHook | None = None, episode_length: int = 7) -> None:
        super().__init__(step_hook=step_hook, episode_length=episode_length)
        self.observation_space = spaces.Box(0, 255, shape=self.SHAPE, dtype=np.uint8)

    def _frame(self) -> np.ndarray:
        frame = self.np_random.integers(0, 256, size=self.SHAPE, dtype=np.uint8)
        frame[0, 0, 0] = self.count % 256
        return frame

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        _, info = super().reset(seed=seed, options=options)
        return self._frame(), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        _, reward, terminated, truncated, info = super().step(action)
        return self._frame(), reward, terminated, truncated, info


class StepEnv(gymnasium.Env[np.ndarray, np.int64]):
    """SB3's terminal-observation env: obs counts up; the episode ends after ``max_steps``."""

    def __init__(self, max_steps: int) -> None:
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(0, 999, shape=(1,), dtype=np.int64)
        self.max_steps = max_steps
        self.current_step = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.current_step = 0
        return np.array([0]), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.current_step += 1
        done = self.current_step >= self.max_steps
        # terminated for the odd lengths, truncated for the even ones
        odd = self.max_steps % 2 == 1
        return np.array([self.current_step]), 0.0, done and odd, done and not odd, {}


IN_PARENT: list[bool] = []
"""Set by a test in this process: a forked worker inherits it, a spawned one does not."""


class InheritingEnv(StepEnv):
    """A :class:`StepEnv` that records whether its process inherited :data:`IN_PARENT` (here,
    not in a test module, so that spawned workers unpickling it import no more than this)."""

    def __init__(self) -> None:
        super().__init__(100)
        self.inherited = bool(IN_PARENT)


class ModulesCartPole(gymnasium.Wrapper[Any, Any, Any, Any]):
    """CartPole that says whether its process has imported a module (this module imports no
    Ray: a worker that unpickles it does not either)."""

    def __init__(self) -> None:
        super().__init__(gymnasium.make("CartPole-v1"))

    def imported(self, name: str) -> bool:
        return name in sys.modules
