"""Policies for ``envfleet run`` and ``envfleet tune``: a batch of observations in, a batch of
actions out.

Usage, from ``examples/``::

    envfleet run CartPole-v1 --policy mypkg.policies:greedy
    envfleet tune CartPole-v1 --policy mypkg.policies:greedy
"""

from __future__ import annotations

import numpy as np


def greedy(observations: np.ndarray) -> np.ndarray:
    """CartPole: push the cart toward the side the pole leans (observations ``(n, 4)``: cart
    position, cart velocity, pole angle, pole angular velocity), one action per env."""
    lean = observations[:, 2] + 0.5 * observations[:, 3]
    return (lean > 0).astype(np.int64)


def toward_goal(observations: np.ndarray) -> np.ndarray:
    """``MySim-v0`` (``mysim.py``): move right when the goal is right of the point."""
    return (observations[:, 1] > observations[:, 0]).astype(np.int64)
