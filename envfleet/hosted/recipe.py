"""What a worker hosting VectorEnvs builds: the blocks of envs and how to build each one's
VectorEnv (:class:`HostedRecipe`), carried by the pool's spec (:class:`HostedSpec`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from gymnasium.vector import VectorEnv

from envfleet.spec import EnvSpec, _register_for

RESTARTED = "envfleet/restarted"

VectorFactory = Callable[[], VectorEnv[Any, Any, Any]]


@dataclass(frozen=True)
class HostedRecipe:
    """How each worker builds its hosted VectorEnv: ``make_vec(env_id, k,
    vectorization_mode="vector_entry_point", **kwargs)`` for a block of ``k`` envs, or the
    block's own factory (``vector_env_fns``); ``blocks``: each block's first env and size."""

    blocks: tuple[tuple[int, int], ...]
    env_id: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    factories: tuple[VectorFactory, ...] = ()

    def build(self, block: int) -> VectorEnv[Any, Any, Any]:
        """The hosted VectorEnv of block ``block``."""
        if self.factories:
            venv = self.factories[block]()
        else:
            assert self.env_id is not None
            _register_for(self.env_id)  # a worker that did not inherit the caller's registry
            size = self.blocks[block][1]
            venv = gymnasium.make_vec(
                self.env_id, size, vectorization_mode="vector_entry_point", **self.kwargs
            )
        if not isinstance(venv, VectorEnv):
            raise TypeError(
                f"a hosted env factory must return a gymnasium.vector.VectorEnv, got "
                f"{type(venv).__name__}"
            )
        if venv.num_envs != self.blocks[block][1]:
            raise ValueError(
                f"the hosted VectorEnv of block {block} has {venv.num_envs} envs, "
                f"{self.blocks[block][1]} expected"
            )
        return venv

    def block_of(self, env: int) -> int:
        """The block holding env ``env``."""
        for b, (start, size) in enumerate(self.blocks):
            if start <= env < start + size:
                return b
        raise ValueError(f"env {env} is in no block of {self.blocks}")


@dataclass(frozen=True)
class HostedSpec(EnvSpec):
    """An :class:`~envfleet.EnvSpec` whose workers host VectorEnvs (:class:`HostedRecipe`)."""

    recipe: HostedRecipe | None = None


__all__ = ["RESTARTED", "HostedRecipe", "HostedSpec", "VectorFactory"]
