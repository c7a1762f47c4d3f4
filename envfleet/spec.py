"""EnvSpec: how to build one environment, whatever the user passed to ``make``."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]

# Namespaces whose ids are registered by importing a package (lazy, EnvPool-style registry).
_REGISTERING_PACKAGES: dict[str, str] = {"ALE": "ale_py"}


def _register_for(env_id: str) -> None:
    """Import the package that registers ``env_id`` when it is not registered yet."""
    if env_id in gymnasium.registry:
        return
    namespace = env_id.split("/", 1)[0] if "/" in env_id else None
    candidates = [_REGISTERING_PACKAGES[namespace]] if namespace in _REGISTERING_PACKAGES else []
    # Bare legacy Atari ids ("Pong-v0", "PongNoFrameskip-v4") are registered by ale_py too.
    candidates += [p for p in _REGISTERING_PACKAGES.values() if p not in candidates]
    for package in candidates:
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        gymnasium.register_envs(module)
        if env_id in gymnasium.registry:
            return


@dataclass(frozen=True)
class EnvSpec:
    """A picklable recipe for one environment.

    Args:
        target: a registered id, a zero-argument callable returning an env, or an env class.
        kwargs: keyword arguments for ``gymnasium.make`` or the factory.
    """

    target: str | EnvFactory
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_user(cls, env: Any, env_kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
        """Validate what the user passed to :func:`envfleet.make`."""
        kwargs = dict(env_kwargs or {})
        if isinstance(env, EnvSpec):
            return cls(env.target, {**env.kwargs, **kwargs})
        if isinstance(env, str):
            _register_for(env)
            if env not in gymnasium.registry:
                try:
                    gymnasium.spec(env)  # raises with Gymnasium's did-you-mean suggestions
                except gymnasium.error.Error as exc:
                    raise ValueError(f"unknown environment id {env!r}: {exc}") from exc
            return cls(env, kwargs)
        if isinstance(env, gymnasium.Env):
            raise TypeError(
                "envfleet.make needs a way to build many copies of the env: pass its id, "
                f"its class or a zero-argument factory, not an instance ({type(env).__name__})"
            )
        if callable(env):
            return cls(env, kwargs)
        raise TypeError(
            "env must be a registered id (str), an env class or a zero-argument callable, "
            f"got {type(env).__name__}"
        )

    @property
    def name(self) -> str:
        """A short human-readable name, for messages."""
        target: Any = self.target
        if isinstance(target, str):
            return target
        while isinstance(target, functools.partial):
            target = target.func
        return str(getattr(target, "__qualname__", None) or type(target).__qualname__)

    def build(self) -> gymnasium.Env[Any, Any]:
        """Build one environment."""
        if isinstance(self.target, str):
            _register_for(self.target)
            return gymnasium.make(self.target, **self.kwargs)
        env = self.target(**self.kwargs)
        if not isinstance(env, gymnasium.Env):
            raise TypeError(
                f"the env factory {self.name} returned {type(env).__name__}, "
                "expected a gymnasium.Env"
            )
        return env
