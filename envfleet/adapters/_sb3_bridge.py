"""The env-side half of the Stable-Baselines3 adapter, kept free of SB3 imports.

Workers unpickle this wrapper when they build their envs, so importing it must stay cheap: no
``stable_baselines3`` (nor torch) here.
"""

from __future__ import annotations

from typing import Any

import gymnasium

SELECTED = "envfleet_sb3_selected"
"""Per-env flag: whether the next targeted call applies to this env."""

IS_BRIDGED = "envfleet_sb3_bridge"
"""Attribute present on (and only on) envs wrapped in :class:`Sb3Bridge`."""


class Sb3Bridge(gymnasium.Wrapper[Any, Any, Any, Any]):
    """A transparent wrapper that lets the SB3 adapter reach single envs of a pool.

    A pool calls a method on every env; SB3 also calls methods on some envs only
    (``env_method(..., indices=[0])``) and checks wrappers by class. The adapter first marks the
    targeted envs (``set_attr(SELECTED, [...])``, one value per env), then calls
    :meth:`envfleet_sb3_env_method`, which acts only where marked.
    """

    envfleet_sb3_bridge = True

    def __init__(self, env: gymnasium.Env[Any, Any]) -> None:
        super().__init__(env)
        self.envfleet_sb3_selected = True

    def envfleet_sb3_is_wrapped(self, wrapper_class: type) -> bool:
        """Whether a wrapper below this one is an instance of ``wrapper_class``."""
        env: Any = self.env
        while isinstance(env, gymnasium.Wrapper):
            if isinstance(env, wrapper_class):
                return True
            env = env.env
        return False

    def envfleet_sb3_env_method(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, Any]:
        """``(True, result)`` of method ``name`` on a selected env, else ``(False, None)``."""
        if not self.envfleet_sb3_selected:
            return False, None
        return True, self.env.get_wrapper_attr(name)(*args, **kwargs)

    def envfleet_sb3_set_attr(self, name: str, value: Any) -> None:
        """Set attribute ``name`` of the wrapped env when this env is selected."""
        if self.envfleet_sb3_selected:
            self.env.set_wrapper_attr(name, value)


__all__ = ["IS_BRIDGED", "SELECTED", "Sb3Bridge"]
