"""envfleet: run many copies of any Gymnasium environment in parallel, behind one VectorEnv.

The public names are imported on first use (PEP 562), so that ``import envfleet`` (and the
``envfleet`` command, whose ``run`` says what it starts before anything heavy is imported)
does not pay for Gymnasium and numpy until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from envfleet.rollouts import Policy, RandomPolicy, Rollout
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
    "Policy",
    "Pool",
    "PoolStateError",
    "RandomPolicy",
    "RemoteError",
    "RemoteTraceback",
    "ResetNeededError",
    "RestartLimitError",
    "Rollout",
    "WorkerDiedError",
    "__version__",
    "make",
    "register_vector",
]

_ERRORS = (
    "AlreadyPendingError",
    "BrokenPoolError",
    "ClosedPoolError",
    "EnvError",
    "EnvRaisedError",
    "EnvTimeoutError",
    "NoPendingError",
    "OnError",
    "Phase",
    "PoolStateError",
    "RemoteError",
    "RemoteTraceback",
    "ResetNeededError",
    "RestartLimitError",
    "WorkerDiedError",
)

_HOMES: dict[str, str] = {
    "AutoresetMode": "gymnasium.vector",
    "Backend": "envfleet.backends",
    "EnvSpec": "envfleet.spec",
    "Pool": "envfleet.pool",
    "Policy": "envfleet.rollouts",
    "RandomPolicy": "envfleet.rollouts",
    "Rollout": "envfleet.rollouts",
    "make": "envfleet._make",
    "register_vector": "envfleet.registration",
    **dict.fromkeys(_ERRORS, "envfleet.errors"),
}
"""The module each public name comes from, imported when the name is first used."""


def __getattr__(name: str) -> Any:
    """The public names, imported on first use; ``envfleet.sb3`` and ``envfleet.make_sb3``
    too (they need SB3)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later uses find it without this hook
        return value
    if name in ("sb3", "make_sb3"):
        module = importlib.import_module("envfleet.sb3")
        return module if name == "sb3" else module.make_sb3
    raise AttributeError(f"module 'envfleet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
