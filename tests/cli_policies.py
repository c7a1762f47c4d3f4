"""Policies for the CLI tests: ``envfleet run ENV --policy tests.cli_policies:NAME``."""

from __future__ import annotations

from typing import Any

import numpy as np


def always_zero(observations: np.ndarray) -> np.ndarray:
    """Action 0 for every env of the batch (Discrete action spaces)."""
    return np.zeros(len(observations), dtype=np.int64)


def wrong_shape(observations: np.ndarray) -> np.ndarray:
    """One action too many: the pool must refuse it."""
    return np.zeros(len(observations) + 1, dtype=np.int64)


def raises(observations: Any) -> Any:
    """A policy with a bug."""
    raise ZeroDivisionError("the policy divided by zero")


not_callable = 42


SEEN_BATCHES: list[int] = []
"""Batch sizes :func:`counting` was called with (it runs in the CLI's own process)."""


def counting(observations: np.ndarray) -> np.ndarray:
    """Action 0 for every env of the batch, noting the batch's size."""
    SEEN_BATCHES.append(len(observations))
    return np.zeros(len(observations), dtype=np.int64)
