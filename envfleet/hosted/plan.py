"""What :func:`envfleet.make` needs for a pool hosting VectorEnvs: its spec with the blocks,
and the probe (spaces, metadata, the hosted env's autoreset mode)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from envfleet.hosted.recipe import HostedRecipe, HostedSpec, VectorFactory
from envfleet.spec import EnvSpec, _register_for


def hosted_plan(
    env: Any,
    num_envs: int | None,
    env_kwargs: Any,
    vectorization_mode: str | None,
    vector_env_fns: Sequence[VectorFactory] | None,
    num_workers: int | None,
) -> tuple[HostedSpec, dict[str, Any]] | None:
    """What :func:`envfleet.make` needs for a hosted pool: its spec (with the blocks) and the
    probe (spaces, metadata, render mode, the hosted env's autoreset mode, ``"workers"``: the
    blocks of each worker); ``None`` when the pool hosts single envs. Builds one VectorEnv per
    factory here (their sizes), or one of one env for an id, and closes them.

    ``vector_env_fns``: a block per factory, a worker per factory unless ``num_workers`` is
    fewer (each worker then hosts a contiguous run of them; more is refused)."""
    if vector_env_fns is None and vectorization_mode in (None, "none"):
        return None
    if vector_env_fns is not None:
        if env is not None:
            raise TypeError("make() takes env or vector_env_fns, not both")
        if vectorization_mode not in (None, "vector_entry_point"):
            raise ValueError(
                f"vectorization_mode={vectorization_mode!r} with vector_env_fns: the "
                "factories build the VectorEnvs; omit vectorization_mode"
            )
        factories = tuple(vector_env_fns)
        if not factories or not all(callable(f) for f in factories):
            raise TypeError("vector_env_fns must be a non-empty sequence of callables")
        if num_workers is not None and num_workers > len(factories):
            raise ValueError(
                f"num_workers={num_workers} exceeds the {len(factories)} vector_env_fns: a "
                "worker hosts one or more whole VectorEnvs (give num_workers <= "
                f"{len(factories)}, or omit it: a worker per VectorEnv)"
            )
        probes = [_probe_factory(f) for f in factories]
        sizes = [p.num_envs for p in probes]
        probe = probes[0]
        for other in probes[1:]:
            other.close()
        workers = num_workers if num_workers is not None else len(factories)
        name = getattr(probe, "spec", None)
        target: Any = name.id if name is not None and getattr(name, "id", None) else factories[0]
        recipe_args: dict[str, Any] = {"factories": factories}
    else:
        if vectorization_mode != "vector_entry_point":
            raise ValueError(
                f"vectorization_mode must be 'vector_entry_point' (or None), got "
                f"{vectorization_mode!r}"
            )
        if isinstance(env, EnvSpec) and isinstance(env.target, str) and not env.per_env:
            if env.wrappers or env.legacy_gym:  # a wrapper wraps one env, not a batch
                raise ValueError(
                    f"vectorization_mode='vector_entry_point' hosts {env.target}'s own "
                    "VectorEnv: it takes no wrappers and no legacy gym id"
                )
            env_kwargs = {**env.kwargs, **(env_kwargs or {})}
            env = env.target
        if not isinstance(env, str):
            raise TypeError(
                "vectorization_mode='vector_entry_point' needs a registered env id (a str), "
                f"got {type(env).__name__}"
            )
        if env_kwargs is not None and not isinstance(env_kwargs, Mapping):
            raise TypeError("env_kwargs must be a mapping for a hosted VectorEnv")
        if num_envs is None:
            raise TypeError("make() needs num_envs with vectorization_mode")
        kwargs = dict(env_kwargs or {})
        _register_for(env)  # an id whose package registers it on import (ALE/...: ale_py)
        try:
            probe = gymnasium.make_vec(env, 1, vectorization_mode="vector_entry_point", **kwargs)
        except gymnasium.error.Error as exc:
            raise ValueError(
                f"{env} has no vector entry point to host ({exc}); use the default "
                "vectorization (single envs)"
            ) from exc
        workers = num_workers if num_workers is not None else 1
        sizes = [len(b) for b in np.array_split(np.arange(num_envs), workers)]
        target = env
        recipe_args = {"env_id": env, "kwargs": kwargs}
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    blocks = tuple((int(s), int(n)) for s, n in zip(starts, sizes, strict=True))
    # Each worker's blocks: a contiguous run of them, split as np.array_split splits (the
    # first len(blocks) % workers workers one more); an id's blocks are one per worker.
    runs = np.array_split(np.arange(len(blocks)), workers)
    try:
        info = {
            "observation_space": probe.single_observation_space,
            "action_space": probe.single_action_space,
            "metadata": dict(probe.metadata),
            "render_mode": probe.render_mode,
            "autoreset_mode": probe.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP),
            "num_envs": int(sum(sizes)),
            "workers": tuple(tuple(int(b) for b in run) for run in runs),
        }
    finally:
        probe.close()
    recipe = HostedRecipe(blocks=blocks, **recipe_args)
    return HostedSpec(target=target, recipe=recipe), info


def _probe_factory(factory: VectorFactory) -> VectorEnv[Any, Any, Any]:
    venv = factory()
    if not isinstance(venv, VectorEnv):
        raise TypeError(
            f"vector_env_fns must build gymnasium.vector.VectorEnv, got {type(venv).__name__}"
        )
    return venv


__all__ = ["hosted_plan"]
