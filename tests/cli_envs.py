"""Environments for the CLI tests, registered on import: ``envfleet run tests.cli_envs:ID``."""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class CrashAfter(gymnasium.Env[np.ndarray, np.int64]):
    """Counts its steps and raises on step ``crash_at`` of its life."""

    def __init__(self, crash_at: int = 7) -> None:
        self.observation_space = spaces.Box(0, 1_000_000, shape=(1,), dtype=np.int64)
        self.action_space = spaces.Discrete(2)
        self.crash_at = crash_at
        self.count = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.array([self.count], dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.count += 1
        if self.count >= self.crash_at:
            raise RuntimeError(f"boom at step {self.count}")
        return np.array([self.count], dtype=np.int64), 1.0, self.count % 3 == 0, False, {}


class Noisy(CrashAfter):
    """Prints banners on construction, as ale-py does from C (fd 2) and libraries from
    Python (stdout), in whichever process builds it; never crashes."""

    def __init__(self) -> None:
        super().__init__(crash_at=10**9)
        os.write(2, b"A.L.E: Arcade Learning Environment (version 0.0.0+test)\n")
        os.write(2, b"NOISY: a warning from the env\n")
        print("NOISY: chatter on stdout", flush=True)


class CrashWithValueError(CrashAfter):
    """Raises ``ValueError`` (the type the CLI's own action checks raise) on step 7."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.count + 1 >= self.crash_at:
            raise ValueError(f"env value error at step {self.count + 1}")
        return super().step(action)


class BrokenConstructor(CrashAfter):
    """Raises ``TypeError`` (the type of make()'s argument checks) when built."""

    def __init__(self) -> None:
        raise TypeError("env type error in __init__")


class Gate(CrashAfter):
    """Waits, when built, until the file named by ``$ENVFLEET_TEST_GATE`` exists (up to 60 s):
    a test holds the pool's start-up there while it looks at what the command printed."""

    def __init__(self) -> None:
        super().__init__(crash_at=10**9)
        gate = os.environ.get("ENVFLEET_TEST_GATE")
        deadline = time.monotonic() + 60
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)


gymnasium.register("CrashAfter-v0", entry_point=CrashAfter)
gymnasium.register("Gate-v0", entry_point=Gate)
gymnasium.register("CrashValueError-v0", entry_point=CrashWithValueError)
gymnasium.register("BrokenConstructor-v0", entry_point=BrokenConstructor)
gymnasium.register("Noisy-v0", entry_point=Noisy)
