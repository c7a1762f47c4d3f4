"""``make()``'s arguments checked at the edge: strings become Enums (:func:`as_enum`), numbers
are checked (:func:`seconds`, :func:`positive_int`), and a hosted VectorEnv's arguments become
its recipe and probe (:func:`hosted_args`, with :mod:`envfleet.hosted`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.affinity import usable_cpus
from envfleet.backends.contract.registry import TransportKind
from envfleet.hosted import hosted_plan
from envfleet.spec import EnvSpec

__all__ = ["as_enum", "hosted_args", "positive_int", "seconds"]


def hosted_args(
    env: Any,
    num_envs: int | None,
    env_kwargs: Any,
    vectorization_mode: str | None,
    vector_env_fns: Sequence[Callable[[], Any]] | None,
    num_workers: Any,
    kind: TransportKind,
    mode: AutoresetMode,
) -> tuple[EnvSpec, dict[str, Any]] | None:
    """A hosted pool's spec and probe (:mod:`envfleet.hosted`), or ``None``: single envs."""
    if vector_env_fns is None and vectorization_mode in (None, "none"):
        return None
    can = kind.capabilities
    workers = None
    if vector_env_fns is None:  # one block per worker: the cores, or one (the serial backend)
        if can.one_worker:
            workers = 1
        elif isinstance(num_workers, int | np.integer) and not isinstance(num_workers, bool):
            workers = positive_int(num_workers, "num_workers")
        elif num_envs is not None:
            workers = min(len(usable_cpus()), positive_int(num_envs, "num_envs"))
    elif isinstance(num_workers, int | np.integer) and not can.one_worker:
        workers = positive_int(num_workers, "num_workers")  # at most a worker per factory
    planned = hosted_plan(env, num_envs, env_kwargs, vectorization_mode, vector_env_fns, workers)
    assert planned is not None
    spec, probe = planned
    hosted_mode = AutoresetMode(probe["autoreset_mode"])
    if hosted_mode is not mode:
        raise ValueError(
            f"the hosted VectorEnv's autoreset mode is {hosted_mode.value}, the pool's "
            f"{mode.value}: make the pool with autoreset_mode={hosted_mode.value!r}"
        )
    assert spec.recipe is not None
    probe["blocks"] = spec.recipe.blocks
    return spec, probe


def as_enum(kind: Any, value: Any, name: str) -> Any:
    """``value`` as a member of ``kind``: a member, its value (``"SameStep"``) or its name in
    any case (``"same_step"``, ``"SAME_STEP"``)."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        if isinstance(value, str) and value.upper() in kind.__members__:
            return kind.__members__[value.upper()]
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"unknown {name} {value!r}: expected one of {choices}") from None


def seconds(value: Any, name: str) -> float:
    """A finite, positive number of seconds (``inf`` and ``nan`` are refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite, positive number of seconds, got {value!r}")
    return float(value)


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)
