"""Episodes: where each env of a pool stands between resets, asked before a step is sent.

An env never reset yet may not be stepped, nor, under autoreset mode ``DISABLED``, an env whose
episode ended until it is reset: both are refused before anything is sent, so the pool stays as
it was. The pool's seed (``make(seed=s)``) is kept here until a reset is sent: a first reset
given no seed resets env ``i`` with ``s + i``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.errors import ResetNeededError
from envfleet.validation import check_seeds


class Episodes:
    """The reset flags and the first seed of one pool's envs.

    Args:
        num_envs: the pool's envs.
        autoreset_mode: the mode they follow (``DISABLED``: an ended episode needs a reset).
        seed: the pool's seed, for its first reset (``None``: none).
    """

    def __init__(self, num_envs: int, autoreset_mode: AutoresetMode, seed: int | None) -> None:
        self.num_envs = num_envs
        self.needs_reset = np.zeros(num_envs, dtype=np.bool_)
        """Envs whose last result ended their episode (set as results are read)."""
        self.never_reset = np.ones(num_envs, dtype=np.bool_)
        """Envs never reset yet."""
        self.all_reset = False
        """Every env has been reset once (the flags above need no look then)."""
        self.first_seed = seed
        self._disabled = autoreset_mode is AutoresetMode.DISABLED

    def seeds(
        self, seed: int | Sequence[int | None] | None, env_ids: np.ndarray, per_env: int
    ) -> list[int | None]:
        """One checked seed per env of ``env_ids``; ``None`` is the pool's seed until a reset
        has been sent (:meth:`reset_sent`)."""
        if seed is None:
            seed = self.first_seed
        return check_seeds(seed, env_ids, per_env, self.num_envs)

    def reset_sent(self, env_ids: np.ndarray) -> None:
        """A reset of ``env_ids`` went out: the pool's seed is spent, and they may be stepped."""
        self.first_seed = None
        if not self.all_reset:
            self.never_reset[env_ids] = False
            self.all_reset = not self.never_reset.any()

    def check_step(self, env_ids: np.ndarray) -> None:
        """Raise if an env of ``env_ids`` may not be stepped now."""
        if not self.all_reset and self.never_reset[env_ids].any():
            never = env_ids[self.never_reset[env_ids]].tolist()
            raise ResetNeededError(
                f"envs {never} have not been reset yet: call reset() (or async_reset()) before "
                "step()/send(); nothing was sent"
            )
        if self._disabled and self.needs_reset[env_ids].any():
            done = env_ids[self.needs_reset[env_ids]].tolist()
            raise ValueError(
                f"envs {done} ended their episode and autoreset_mode is DISABLED: reset them "
                "first (reset(options={'reset_mask': mask}) or async_reset(env_id=...))"
            )

    def check_rollout(self) -> None:
        """Raise if an env was never reset: a rollout steps every env."""
        if not self.all_reset:
            raise ResetNeededError(
                f"envs {np.flatnonzero(self.never_reset).tolist()} have not been reset yet: "
                "call reset() before rollout(); nothing was sent"
            )


__all__ = ["Episodes"]
