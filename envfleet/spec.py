"""EnvSpec: how to build one environment, whatever the user passed to ``make``.

Legacy ``gym`` environments are converted here (by :mod:`envfleet.legacy`), so nothing above
this module knows about them: an id missing from Gymnasium's registry is looked up in the legacy
``gym`` registry, and a factory that returns a legacy env (a ``gym.Env``, or any object with the
old ``reset``/``step`` API) has its env wrapped into a ``gymnasium.Env``. The caller's registry
entries that travel with a recipe to its workers are :mod:`envfleet.caller_registry`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from envfleet.caller_registry import CallerRegistry
from envfleet.id_hints import unknown_id_message
from envfleet.legacy import as_gymnasium, in_legacy_gym_registry, is_legacy_env, legacy_gym_make

EnvFactory = Callable[..., gymnasium.Env[Any, Any]]
EnvWrapper = Callable[[gymnasium.Env[Any, Any]], gymnasium.Env[Any, Any]]

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
    """A picklable recipe for the environments of a pool: one recipe for all, or one per env.

    Args:
        target: a registered id, a zero-argument callable returning an env, or an env class.
        kwargs: keyword arguments for ``gymnasium.make`` or the factory.
        legacy_gym: ``target`` is an id of the legacy ``gym`` registry (not Gymnasium's).
        wrappers: applied in order to each env once built (and converted from legacy gym).
        registered: for an id, its Gymnasium registry entry as resolved in the caller's
            process, so that a worker whose registry lacks the id (spawn, forkserver, Ray)
            builds the same env.
        per_env: one recipe per env (``env_fns``, a list of ids or a per-env ``env_kwargs``):
            env ``i`` is built by ``per_env[i]``; the other fields then describe env 0.
        caller_registry: the caller's Gymnasium registry entries (:class:`CallerRegistry`),
            installed in a worker before it builds an env, so that a factory calling
            ``gymnasium.make(id)`` on an id registered in the caller (``import ale_py``,
            ``gymnasium.register``) builds it in spawned workers and Ray actors too.

    :func:`envfleet.make` makes one from what it is given (:meth:`from_user`); build one
    yourself to check, before starting workers, that an env resolves and builds.

    Examples:
        >>> from envfleet import EnvSpec
        >>> spec = EnvSpec.from_user("CartPole-v1", {"max_episode_steps": 50})
        >>> spec.name
        'CartPole-v1'
        >>> env = spec.build()
        >>> env.spec.max_episode_steps
        50
        >>> env.close()
    """

    target: str | EnvFactory
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    legacy_gym: bool = False
    wrappers: tuple[EnvWrapper, ...] = ()
    registered: Any = None
    per_env: tuple[EnvSpec, ...] = ()
    caller_registry: CallerRegistry | None = None

    @classmethod
    def from_user(
        cls,
        env: Any,
        env_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> EnvSpec:
        """Validate what the user passed to :func:`envfleet.make`.

        ``env`` may be a sequence (one id, class or factory per env, as Gymnasium's
        ``AsyncVectorEnv(env_fns)``) and ``env_kwargs`` a sequence of mappings (one per env);
        either gives a recipe per env.
        """
        per_env_kwargs = _per_env_kwargs(env_kwargs)
        shared = env_kwargs if isinstance(env_kwargs, Mapping) else None  # one for every env
        if _is_env_list(env):
            targets = list(env)
            if not targets:
                raise ValueError("env_fns is empty: pass at least one env factory")
            if per_env_kwargs is not None and len(per_env_kwargs) != len(targets):
                raise ValueError(
                    f"env_kwargs has {len(per_env_kwargs)} entries for {len(targets)} envs: "
                    "give one mapping per env, or one mapping for all"
                )
            specs = tuple(
                cls.from_user(target, per_env_kwargs[i] if per_env_kwargs is not None else shared)
                for i, target in enumerate(targets)
            )
            return cls.of_envs(specs)
        if per_env_kwargs is not None:
            single = cls.from_user(env)
            return cls.of_envs(tuple(cls.from_user(single, kw) for kw in per_env_kwargs))
        kwargs = dict(shared or {})
        if isinstance(env, EnvSpec):
            if env.per_env:
                return cls.of_envs(tuple(cls.from_user(one, kwargs) for one in env.per_env))
            registered = env.registered
            if registered is None and isinstance(env.target, str) and not env.legacy_gym:
                registered = gymnasium.registry.get(env.target)  # so fresh workers build it too
            return dataclasses.replace(env, kwargs={**env.kwargs, **kwargs}, registered=registered)
        if isinstance(env, str):
            _register_for(env)
            if env in gymnasium.registry or _in_gymnasium_registry_after_import(env):
                registered = gymnasium.spec(env) if env in gymnasium.registry else None
                return cls(env, kwargs, registered=registered)
            if in_legacy_gym_registry(env):
                return cls(env, kwargs, legacy_gym=True)
            try:
                gymnasium.spec(env)
            except gymnasium.error.Error:
                # Our own message (the nearest registered ids, or the extra the id needs) stands
                # alone: Gymnasium's error and its traceback would only come before it.
                raise ValueError(unknown_id_message(env)) from None
            return cls(env, kwargs)
        if isinstance(env, gymnasium.Env) or is_legacy_env(env):
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

    @classmethod
    def of_envs(cls, specs: tuple[EnvSpec, ...]) -> EnvSpec:
        """One recipe per env: env ``i`` is built by ``specs[i]`` (one spec is one env too, as
        ``AsyncVectorEnv([make_env])`` is)."""
        first = specs[0]
        return dataclasses.replace(first, per_env=specs)

    def wrapped(self, wrappers: Sequence[EnvWrapper]) -> EnvSpec:
        """This recipe with ``wrappers`` applied after its own, to every env (each recipe of a
        per-env recipe too); every other field is kept."""
        if not wrappers:
            return self
        return dataclasses.replace(
            self,
            wrappers=(*self.wrappers, *wrappers),
            per_env=tuple(spec.wrapped(wrappers) for spec in self.per_env),
        )

    @property
    def num_envs(self) -> int | None:
        """How many envs the recipe describes (``None``: any number of copies)."""
        return len(self.per_env) if self.per_env else None

    def for_env(self, index: int) -> EnvSpec:
        """The recipe of env ``index``."""
        if self.per_env:
            spec = self.per_env[index]
            if spec.caller_registry is None and self.caller_registry is not None:
                spec = dataclasses.replace(spec, caller_registry=self.caller_registry)
            return spec
        return self

    @property
    def name(self) -> str:
        """A short human-readable name, for messages."""
        if self.per_env:
            names = list(dict.fromkeys(spec.name for spec in self.per_env))
            return names[0] if len(names) == 1 else f"[{', '.join(names)}]"
        target: Any = self.target
        if isinstance(target, str):
            return target
        while isinstance(target, functools.partial):
            if target.func is gymnasium.make and target.args and isinstance(target.args[0], str):
                return target.args[0]  # functools.partial(gymnasium.make, "CartPole-v1")
            target = target.func
        return str(getattr(target, "__qualname__", None) or type(target).__qualname__)

    def build(self) -> gymnasium.Env[Any, Any]:
        """Build one environment (env 0 of a per-env recipe); a legacy gym env comes back
        converted to Gymnasium's API."""
        env: gymnasium.Env[Any, Any]
        if self.caller_registry is not None:
            self.caller_registry.install()
        if isinstance(self.target, str) and self.legacy_gym:
            env = as_gymnasium(legacy_gym_make(self.target, self.kwargs))
        elif isinstance(self.target, str) and self.registered is not None:
            # The entry as resolved in the caller's process, whatever this process's registry
            # holds: a spawned worker or a Ray actor may lack the id, or have another entry for
            # it (one the caller registered over a built-in id).
            env = _make_registered(self.target, self.registered, self.kwargs)
        elif isinstance(self.target, str):
            _register_for(self.target)
            env = gymnasium.make(self.target, **self.kwargs)
        else:
            made = self.target(**self.kwargs)
            if not isinstance(made, gymnasium.Env) and not is_legacy_env(made):
                raise TypeError(
                    f"the env factory {self.name} returned {type(made).__name__}, "
                    "expected a gymnasium.Env (or a legacy gym.Env)"
                )
            env = as_gymnasium(made)
        for wrapper in self.wrappers:
            env = wrapper(env)
        return env


def _is_env_list(env: Any) -> bool:
    """A sequence of per-env targets (``env_fns``), not one target."""
    return isinstance(env, Sequence) and not isinstance(env, str | bytes)


def _per_env_kwargs(env_kwargs: Any) -> list[Mapping[str, Any]] | None:
    """``env_kwargs`` as one mapping per env, or ``None`` when it is one mapping for all."""
    if env_kwargs is None or isinstance(env_kwargs, Mapping):
        return None
    if isinstance(env_kwargs, Sequence) and not isinstance(env_kwargs, str | bytes):
        kwargs = list(env_kwargs)
        for i, one in enumerate(kwargs):
            if not isinstance(one, Mapping):
                raise TypeError(
                    f"env_kwargs[{i}] must be a mapping of keyword arguments, "
                    f"got {type(one).__name__}"
                )
        if not kwargs:
            raise ValueError("env_kwargs is an empty list: give one mapping per env")
        return kwargs
    raise TypeError(
        "env_kwargs must be a mapping (for every env) or a sequence of mappings (one per env), "
        f"got {type(env_kwargs).__name__}"
    )


def _make_registered(env_id: str, registered: Any, kwargs: Mapping[str, Any]) -> Any:
    """``gymnasium.make`` of an id registered in the caller's process but not in this one."""
    try:
        return gymnasium.make(registered, **kwargs)
    except ImportError as exc:
        raise ImportError(
            f"{env_id!r} is registered in the process that made the pool with the entry point "
            f"{registered.entry_point!r}, which cannot be imported in this worker ({exc}). "
            "Make its module importable there (an installed package, or its folder on "
            "PYTHONPATH; with Ray, ray_init_kwargs={'runtime_env': {'py_modules': [...]}}), "
            "pass an env class or factory instead of the id, or use backend='process' with "
            "context='fork', whose workers inherit this process's modules"
        ) from exc


def _in_gymnasium_registry_after_import(env_id: str) -> bool:
    """``"module:Env-v0"``: whether importing ``module`` registers ``Env-v0`` with Gymnasium."""
    module_name, sep, bare_id = env_id.rpartition(":")
    if not sep:
        return False
    try:
        importlib.import_module(module_name)
    except ImportError:
        return False
    return bare_id in gymnasium.registry


__all__ = ["EnvFactory", "EnvSpec", "EnvWrapper"]
