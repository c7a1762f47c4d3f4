"""Hooks that block an env until the test opens a gate (a file: it works across processes)."""

from __future__ import annotations

import os
import time
from typing import Any

from tests.envs import FaultyEnv


def wait_for_file(env: FaultyEnv, action: Any, *, path: str, env_seed: int) -> None:
    """Block the env reset with ``env_seed`` until ``path`` exists (at most 60 s)."""
    if env.seed_used != env_seed:
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.002)
