"""envfleet: run many copies of any Gymnasium environment in parallel, behind one VectorEnv."""

import importlib
from typing import Any

from gymnasium.vector import AutoresetMode

from envfleet._make import make
from envfleet.backends import Backend
from envfleet.errors import (
    AlreadyPendingError,
    BrokenPoolError,
    ClosedPoolError,
    EnvError,
    EnvRaisedError,
    EnvTimeoutError,
    NoPendingError,
    OnError,
    Phase,
    PoolStateError,
    RemoteError,
    RemoteTraceback,
    ResetNeededError,
    RestartLimitError,
    WorkerDiedError,
)
from envfleet.pool import Pool
from envfleet.registration import register_vector
from envfleet.spec import EnvSpec

__version__ = "0.1.0"

__all__ = [
    "AlreadyPendingError",
    "AutoresetMode",
    "Backend",
    "BrokenPoolError",
    "ClosedPoolError",
    "EnvError",
    "EnvRaisedError",
    "EnvSpec",
    "EnvTimeoutError",
    "NoPendingError",
    "OnError",
    "Phase",
    "Pool",
    "PoolStateError",
    "RemoteError",
    "RemoteTraceback",
    "ResetNeededError",
    "RestartLimitError",
    "WorkerDiedError",
    "__version__",
    "make",
    "register_vector",
]


def __getattr__(name: str) -> Any:
    """``envfleet.sb3`` and ``envfleet.make_sb3``, imported on first use (they need SB3)."""
    if name in ("sb3", "make_sb3"):
        module = importlib.import_module("envfleet.sb3")
        return module if name == "sb3" else module.make_sb3
    raise AttributeError(f"module 'envfleet' has no attribute {name!r}")
