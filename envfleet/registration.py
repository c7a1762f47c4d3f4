"""Gymnasium registration: ``gymnasium.make_vec(id, n, vectorization_mode="vector_entry_point")``
returns an envfleet :class:`~envfleet.Pool` for the ids you choose.

>>> import gymnasium
>>> from envfleet.registration import register_vector
>>> _ = register_vector("envfleet/CartPole-v1", "CartPole-v1", backend="serial")
>>> pool = gymnasium.make_vec("envfleet/CartPole-v1", 3, vectorization_mode="vector_entry_point")
>>> type(pool).__name__, pool.num_envs, pool.metadata["autoreset_mode"].value
('Pool', 3, 'NextStep')
>>> pool.close()
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec as GymEnvSpec
from gymnasium.wrappers import TimeLimit

from envfleet._make import make
from envfleet.pool import Pool
from envfleet.spec import EnvSpec, _register_for

POOL_OPTIONS = frozenset(inspect.signature(make).parameters) - {"env", "num_envs", "env_kwargs"}
"""Keywords of :func:`envfleet.make` that configure the pool (the others go to the env)."""


@dataclasses.dataclass(frozen=True)
class VectorEntryPoint:
    """The ``vector_entry_point`` of a registered id: builds a pool from ``make_vec``'s kwargs.

    ``gymnasium.make_vec`` calls it with ``num_envs`` and the spec's and caller's keyword
    arguments: those named like :func:`envfleet.make` parameters (``backend``, ``num_workers``,
    ``seed``, ``autoreset_mode``...) configure the pool, the rest go to each env (the caller's
    override the registered defaults); ``max_episode_steps`` adds a time limit.
    """

    env: Any
    pool_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, num_envs: int = 1, **kwargs: Any) -> Pool:
        options = dict(self.pool_options)
        env_kwargs: dict[str, Any] = {}
        for key, value in kwargs.items():
            (options if key in POOL_OPTIONS else env_kwargs)[key] = value
        env_kwargs = {**(options.pop("env_kwargs", None) or {}), **env_kwargs}
        max_episode_steps = env_kwargs.pop("max_episode_steps", None)
        spec = EnvSpec.from_user(self.env)
        if max_episode_steps is not None:
            if isinstance(spec.target, str) and not spec.legacy_gym:
                env_kwargs["max_episode_steps"] = max_episode_steps  # gymnasium.make's own
            else:
                limit = functools.partial(TimeLimit, max_episode_steps=int(max_episode_steps))
                spec = spec.wrapped([limit])
        return make(spec, num_envs, env_kwargs=env_kwargs, **options)


def register_vector(
    id: str,
    env: Any = None,
    *,
    max_episode_steps: int | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    **pool_options: Any,
) -> GymEnvSpec:
    """Make ``gymnasium.make_vec(id, n, vectorization_mode="vector_entry_point")`` an envfleet pool.

    Args:
        id: the Gymnasium id to register (or to give envfleet as its vector entry point).
        env: what the pool runs: an id, an env class or a factory (anything
            :func:`envfleet.make` takes). ``None``: ``id`` must already be registered; its
            single-env entry point stays and only its vector entry point changes.
        max_episode_steps: time limit of each env (``None``: the one ``env``'s spec has).
        env_kwargs: default keyword arguments for each env.
        **pool_options: default :func:`envfleet.make` arguments (``backend``,
            ``num_workers``, ``autoreset_mode``...); ``make_vec`` kwargs override them.

    Returns:
        The registered Gymnasium ``EnvSpec``; ``gymnasium.make(id)`` still builds one env.

    Raises:
        ValueError: ``env`` is ``None`` and ``id`` is not registered, or an option is not an
            :func:`envfleet.make` argument.
    """
    unknown = set(pool_options) - POOL_OPTIONS
    if unknown:
        raise ValueError(
            f"unknown envfleet.make options {sorted(unknown)}: pass env arguments as env_kwargs"
        )
    defaults = dict(pool_options)
    if env_kwargs:
        defaults["env_kwargs"] = dict(env_kwargs)
    if env is None:
        _register_for(id)
        if id not in gymnasium.registry:
            raise ValueError(
                f"{id!r} is not registered: pass the env to run as register_vector(id, env)"
            )
        existing = gymnasium.spec(id)
        spec = dataclasses.replace(
            existing,
            vector_entry_point=VectorEntryPoint(id, defaults),
            max_episode_steps=max_episode_steps or existing.max_episode_steps,
        )
        gymnasium.registry[id] = spec
        return spec
    entry_point: Any = env
    if isinstance(env, str):
        base = EnvSpec.from_user(env)
        if base.legacy_gym or env not in gymnasium.registry:
            entry_point = functools.partial(_make_one, base)
        else:
            # Copy the base id's spec, so gymnasium.make(id) builds what gymnasium.make(env) does.
            base_spec = gymnasium.spec(env)
            entry_point = base_spec.entry_point
            env_kwargs = {**base_spec.kwargs, **(env_kwargs or {})}
            if max_episode_steps is None:
                max_episode_steps = base_spec.max_episode_steps
    else:
        # Built as envfleet builds it (a legacy env comes converted); validated now.
        entry_point = functools.partial(_make_one, EnvSpec.from_user(env))
    gymnasium.register(
        id,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        kwargs=dict(env_kwargs or {}),
        vector_entry_point=VectorEntryPoint(env, defaults),
    )
    return gymnasium.spec(id)


def _make_one(spec: EnvSpec, **kwargs: Any) -> gymnasium.Env[Any, Any]:
    """Single-env entry point: the env as a pool's worker builds it."""
    return dataclasses.replace(spec, kwargs={**spec.kwargs, **kwargs}).build()


__all__ = ["VectorEntryPoint", "register_vector"]
