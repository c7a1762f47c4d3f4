"""Envs of the legacy gym API, for the legacy-gym tests (module level: workers unpickle them).

:class:`OldApiCounterEnv` imports nothing from ``gym``: it is a duck-typed gym 0.21 env
(``seed()``, ``reset() -> obs``, ``step -> (obs, reward, done, info)`` with
``info["TimeLimit.truncated"]``). When the ``gym`` package is installed, :class:`GymCounterEnv`
is the same env as a real ``gym.Env`` subclass with ``gym.spaces``, and importing this module
registers ``LegacyGymCartPole-v1`` (gym's own CartPole) in gym's registry only.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces

TARGET = 3
"""Counting up to this ends the episode (terminated)."""

MAX_STEPS = 5
"""After this many steps the episode is cut (done with ``TimeLimit.truncated``)."""

LEGACY_GYM_ID = "LegacyGymCartPole-v1"
LEGACY_GYM_MAX_STEPS = 7


def start_of(seed: int) -> int:
    """The first observation's offset for ``seed``, as the envs draw it."""
    return int(np.random.RandomState(seed).randint(0, 100))


class OldApiCounterEnv:
    """Counts the 1-actions from a seeded offset: obs ``[offset + count, t]``, reward = action.

    ``done`` when the count reaches :data:`TARGET`; after :data:`MAX_STEPS` steps without it,
    ``done`` with ``info["TimeLimit.truncated"] = True`` (as gym 0.21's ``TimeLimit``).
    """

    metadata: ClassVar[dict[str, Any]] = {"render.modes": ["rgb_array"]}

    def __init__(self) -> None:
        self.observation_space = self._spaces()[0]
        self.action_space = self._spaces()[1]
        self.reward_range = (0.0, 1.0)
        self.seeds: list[int | None] = []
        self._rng = np.random.RandomState(0)
        self._offset = 0
        self._count = 0
        self._t = 0

    def _spaces(self) -> tuple[Any, Any]:
        return (
            spaces.Box(0.0, 1000.0, shape=(2,), dtype=np.float32),
            spaces.Discrete(2),
        )

    def seed(self, seed: int | None = None) -> list[int | None]:
        self.seeds.append(seed)
        self._rng = np.random.RandomState(seed)
        return [seed]

    def reset(self) -> np.ndarray:
        self._offset = int(self._rng.randint(0, 100))
        self._count = 0
        self._t = 0
        return self._obs()

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        self._t += 1
        self._count += int(action)
        info: dict[str, Any] = {"t": self._t}
        done = self._count >= TARGET
        if not done and self._t >= MAX_STEPS:
            done = True
            info["TimeLimit.truncated"] = True
        return self._obs(), float(action), done, info

    def render(self, mode: str = "human") -> np.ndarray:
        assert mode == "rgb_array", mode
        return np.full((2, 2, 3), self._t, dtype=np.uint8)

    def close(self) -> None:
        pass

    def _obs(self) -> np.ndarray:
        return np.array([self._offset + self._count, self._t], dtype=np.float32)


class NewApiDuckEnv(OldApiCounterEnv):
    """Duck-typed gym 0.26 style: ``reset(seed=, options=) -> (obs, info)``, 5-tuple step."""

    def reset(  # type: ignore[override]
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self.seed(seed)
        return super().reset(), {"options": options}

    def step(  # type: ignore[override]
        self, action: Any
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, done, info = super().step(action)
        truncated = bool(info.pop("TimeLimit.truncated", False))
        return obs, reward, done and not truncated, truncated, info


GYM_INSTALLED = importlib.util.find_spec("gym") is not None

if GYM_INSTALLED:
    import gym

    class GymCounterEnv(OldApiCounterEnv, gym.Env):  # type: ignore[misc]
        """:class:`OldApiCounterEnv` as a ``gym.Env`` with ``gym.spaces`` (Shimmy's V21 path)."""

        def _spaces(self) -> tuple[Any, Any]:
            return (
                gym.spaces.Box(0.0, 1000.0, shape=(2,), dtype=np.float32),
                gym.spaces.Discrete(2),
            )

    if LEGACY_GYM_ID not in gym.envs.registry:
        gym.register(
            LEGACY_GYM_ID,
            entry_point="gym.envs.classic_control.cartpole:CartPoleEnv",
            max_episode_steps=LEGACY_GYM_MAX_STEPS,
        )
