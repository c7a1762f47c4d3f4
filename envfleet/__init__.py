"""envfleet: run many copies of any Gymnasium environment in parallel, behind one VectorEnv.

Everything public is here: :func:`make` builds a :class:`Pool` (a ``gymnasium.vector.VectorEnv``);
:class:`Rollout`, :class:`RandomPolicy` and :class:`Policy` are ``Pool.rollout``'s, and
:class:`TorchPolicy` a PyTorch module as such a policy (torch imported only when it is built);
:class:`EnvError` and its subclasses say which env failed, in which :class:`Phase`;
:func:`register_vector` and :class:`EnvSpec` describe envs; :func:`make_sb3` (with
``envfleet[sb3]``) wraps a pool as a Stable-Baselines3 ``VecEnv``.

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
    from envfleet.adapters.sb3 import VecEnv
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
    from envfleet.torch_policy import TorchPolicy

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
    "TorchPolicy",
    "WorkerDiedError",
    "__version__",
    "make",
    "make_sb3",
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
    "TorchPolicy": "envfleet.torch_policy",
    "make": "envfleet._make",
    "register_vector": "envfleet.registration",
    **dict.fromkeys(_ERRORS, "envfleet.errors"),
}
"""The module each public name comes from, imported when the name is first used."""


def __getattr__(name: str) -> Any:
    """The public names, imported on first use; ``envfleet.sb3`` too (it needs SB3)."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later uses find it without this hook
        return value
    if name == "sb3":
        return importlib.import_module("envfleet.sb3")
    raise AttributeError(f"module 'envfleet' has no attribute {name!r}")


def make_sb3(env: Any, num_envs: int | None = None, **kwargs: Any) -> VecEnv:
    """:func:`make` for Stable-Baselines3: an SB3 ``VecEnv`` over a new pool.

    Needs ``pip install 'envfleet[sb3]'``; SB3 (and torch) are imported on the first call, not
    by ``import envfleet``. The arguments are those of ``envfleet.sb3.make_sb3``: ``make()``'s,
    plus ``wrappers`` and SB3's ``start_method``.

    Raises:
        ImportError: Stable-Baselines3 is not installed (the message says what to install).
    """
    from envfleet.sb3 import make_sb3 as make_vec_env

    return make_vec_env(env, num_envs, **kwargs)


def __dir__() -> list[str]:
    """The public names and ``sb3``, without this module's own imports."""
    dunders = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted({*__all__, "sb3", *dunders})
