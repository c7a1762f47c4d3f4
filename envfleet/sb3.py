"""Stable-Baselines3 adapter: ``envfleet.sb3.VecEnv(pool)`` and ``envfleet.sb3.make_sb3``."""

from envfleet.adapters.sb3 import VecEnv, make_sb3, to_sb3_infos, unbatch_infos

__all__ = ["VecEnv", "make_sb3", "to_sb3_infos", "unbatch_infos"]
