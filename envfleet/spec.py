"""EnvSpec: how to build one environment, whatever the user passed to ``make``.

Legacy ``gym`` environments are converted here, so nothing above this module knows about them:
an id missing from Gymnasium's registry is looked up in the legacy ``gym`` registry, and a
factory that returns a legacy env (a ``gym.Env``, or any object with the old ``reset``/``step``
API) has its env wrapped into a ``gymnasium.Env`` by :func:`as_gymnasium`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium import spaces

from envfleet.id_hints import unknown_id_message

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
                cls.from_user(
                    target,
                    per_env_kwargs[i] if per_env_kwargs is not None else env_kwargs,  # type: ignore[arg-type]
                )
                for i, target in enumerate(targets)
            )
            return cls.of_envs(specs)
        if per_env_kwargs is not None:
            single = cls.from_user(env)
            return cls.of_envs(tuple(cls.from_user(single, kw) for kw in per_env_kwargs))
        kwargs = dict(env_kwargs or {})  # type: ignore[arg-type]
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
            if _in_legacy_gym_registry(env):
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
        env: Any
        if self.caller_registry is not None:
            self.caller_registry.install()
        if isinstance(self.target, str) and self.legacy_gym:
            env = as_gymnasium(_legacy_gym_make(self.target, self.kwargs))
        elif isinstance(self.target, str) and self.registered is not None:
            # The entry as resolved in the caller's process, whatever this process's registry
            # holds: a spawned worker or a Ray actor may lack the id, or have another entry for
            # it (one the caller registered over a built-in id).
            env = _make_registered(self.target, self.registered, self.kwargs)
        elif isinstance(self.target, str):
            _register_for(self.target)
            env = gymnasium.make(self.target, **self.kwargs)
        else:
            env = self.target(**self.kwargs)
            if not isinstance(env, gymnasium.Env):
                if not is_legacy_env(env):
                    raise TypeError(
                        f"the env factory {self.name} returned {type(env).__name__}, "
                        "expected a gymnasium.Env (or a legacy gym.Env)"
                    )
                env = as_gymnasium(env)
        for wrapper in self.wrappers:
            env = wrapper(env)
        return env  # type: ignore[no-any-return]


@dataclass(frozen=True, eq=False)
class CallerRegistry:
    """The Gymnasium registry entries of the process that made a pool, for its workers.

    A factory may call ``gymnasium.make(id)`` on an id that the caller registered
    (``import ale_py`` registers the ALE ids; ``gymnasium.register`` a user's): a forked worker
    inherits them, a spawned or forkserver worker and a Ray actor do not. The entries that a
    fresh ``import gymnasium`` does not make (any whose entry point is not Gymnasium's own) and
    that can travel (an entry point named by a string, or a callable cloudpickle takes) go with
    the recipe; :meth:`install` puts them in a worker's registry (the caller's entry wins over
    one of the same id there), and never in the caller's own process.
    """

    entries: tuple[Any, ...]
    pid: int

    @classmethod
    def snapshot(cls) -> CallerRegistry:
        """This process's entries (cached until the registry changes)."""
        values = tuple(gymnasium.registry.values())
        key = tuple(map(id, values))
        cached = _SNAPSHOT.get(key)
        if cached is not None and cached.pid == os.getpid():
            return cached
        entries = tuple(spec for spec in values if not _gymnasiums_own(spec))
        try:
            cloudpickle.dumps(entries)
        except Exception:  # an entry that cannot travel stays behind (the others still go)
            entries = tuple(spec for spec in entries if _travels(spec))
        snapshot = cls(entries, os.getpid())
        _SNAPSHOT.clear()
        _SNAPSHOT[key] = snapshot
        return snapshot

    def install(self) -> None:
        """Register the caller's entries in this process (once; not in the caller's)."""
        if self.pid == os.getpid() or self in _INSTALLED:
            return
        registry = gymnasium.registry
        for spec in self.entries:
            if registry.get(spec.id) != spec:
                registry[spec.id] = spec
        _INSTALLED.add(self)


_SNAPSHOT: dict[tuple[int, ...], CallerRegistry] = {}
_INSTALLED: weakref.WeakSet[CallerRegistry] = weakref.WeakSet()  # installed in this process


def _gymnasiums_own(spec: Any) -> bool:
    """An entry that ``import gymnasium`` makes in every process."""
    entry = spec.entry_point
    module = entry if isinstance(entry, str) else getattr(entry, "__module__", None) or ""
    return module.startswith("gymnasium.")


def _travels(spec: Any) -> bool:
    try:
        cloudpickle.dumps(spec)
    except Exception:
        return False
    return True


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


# -- legacy gym -----------------------------------------------------------------------------------


def _is_legacy_gym_class(cls: type) -> bool:
    """Whether ``cls`` derives from a class of the legacy ``gym`` package (without importing it)."""
    return any(
        getattr(base, "__module__", "") == "gym"
        or getattr(base, "__module__", "").startswith("gym.")
        for base in cls.__mro__
    )


def is_legacy_env(obj: Any) -> bool:
    """Whether ``obj`` is an env instance of the legacy gym API rather than a ``gymnasium.Env``.

    True for instances of ``gym.Env`` (detected by module name: ``gym`` is not imported) and for
    duck-typed envs: objects with ``reset``, ``step``, ``observation_space`` and ``action_space``.
    """
    if isinstance(obj, gymnasium.Env | type):
        return False
    if _is_legacy_gym_class(type(obj)):
        return True
    return (
        callable(getattr(obj, "reset", None))
        and callable(getattr(obj, "step", None))
        and hasattr(obj, "observation_space")
        and hasattr(obj, "action_space")
    )


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


def _in_legacy_gym_registry(env_id: str) -> bool:
    """Whether the legacy ``gym`` package is installed and registers ``env_id``.

    ``"module:Env-v0"`` imports ``module`` first (it may register the id), as ``gym.make`` does.
    """
    if importlib.util.find_spec("gym") is None:
        return False
    module_name, sep, bare_id = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module_name)
        except ImportError:
            return False
    gym = _import_gym()
    try:
        gym.spec(bare_id)
    except Exception:  # gym raises its own error types (and versions differ)
        return False
    return True


def _import_gym() -> Any:
    """Import the legacy ``gym`` package without its import-time banner.

    gym 0.26 prints an "unmaintained" notice to stderr when imported; here it is only a registry
    to look ids up in (a user who imports gym still sees it), so the notice stays out of the
    output of a lookup such as the one behind an "unknown environment id" error.
    """
    if "gym" in sys.modules:
        return sys.modules["gym"]
    with contextlib.redirect_stderr(io.StringIO()):
        return importlib.import_module("gym")


def _legacy_gym_make(env_id: str, kwargs: Mapping[str, Any]) -> Any:
    gym = _import_gym()
    module_name, sep, bare_id = env_id.rpartition(":")
    if sep:
        importlib.import_module(module_name)
    return gym.make(bare_id, **kwargs)


def as_gymnasium(env: Any) -> gymnasium.Env[Any, Any]:
    """Convert a legacy gym env to a ``gymnasium.Env`` (a Gymnasium env is returned as is).

    A ``gym`` env whose spaces are ``gym.spaces`` goes through Shimmy's compatibility wrappers:
    ``GymV26CompatibilityV0`` when its ``reset`` takes ``seed`` (gym >= 0.26), else
    ``GymV21CompatibilityV0``. Other legacy-style envs (duck-typed, or without Shimmy and gym
    installed) go through :class:`LegacyEnv`. Either way a 4-tuple ``step`` has its ``done``
    split into terminated/truncated by ``info["TimeLimit.truncated"]``.
    """
    if isinstance(env, gymnasium.Env):
        return env
    if not is_legacy_env(env):
        raise TypeError(f"{type(env).__name__} is neither a gymnasium.Env nor a legacy gym env")
    env = _without_numpy2_broken_checker(env)
    takes_seed = _reset_takes_seed(env)
    shimmy_wrapper = _shimmy_wrapper(env, takes_seed)
    if shimmy_wrapper is not None:
        converted: gymnasium.Env[Any, Any] = shimmy_wrapper(env=env)
        return converted
    return LegacyEnv(env, takes_seed=takes_seed)


def _reset_takes_seed(env: Any) -> bool:
    """Whether the env's ``reset`` accepts ``seed`` (gym >= 0.22) or not (gym 0.21 and older).

    Wrappers of gym 0.21 already had ``reset(**kwargs)``, so the innermost env decides.
    """
    for candidate in (getattr(env, "unwrapped", None), env):
        reset = getattr(candidate, "reset", None)
        if reset is None:
            continue
        try:
            parameters = inspect.signature(reset).parameters
        except (TypeError, ValueError):
            continue
        return "seed" in parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
        )
    return False


def _shimmy_wrapper(env: Any, takes_seed: bool) -> Callable[..., gymnasium.Env[Any, Any]] | None:
    """Shimmy's wrapper class for ``env``, or ``None`` when Shimmy cannot convert it."""
    gym = sys.modules.get("gym")
    if gym is None or importlib.util.find_spec("shimmy") is None:
        return None
    gym_space = getattr(getattr(gym, "spaces", None), "Space", None)
    if gym_space is None or not all(
        isinstance(space, gym_space) for space in (env.observation_space, env.action_space)
    ):
        return None  # Shimmy converts gym spaces only
    from shimmy.openai_gym_compatibility import GymV21CompatibilityV0, GymV26CompatibilityV0

    return GymV26CompatibilityV0 if takes_seed else GymV21CompatibilityV0  # type: ignore[no-any-return]


def _without_numpy2_broken_checker(env: Any) -> Any:
    """Take gym 0.26's ``PassiveEnvChecker`` out of the wrapper chain under NumPy 2.

    Its first ``step`` checks ``isinstance(done, np.bool8)``, an alias NumPy 2 removed, so with
    NumPy 2 every ``gym.make``-built env would raise ``AttributeError`` on its first step.
    """
    if hasattr(np, "bool8"):
        return env
    outer: Any = None
    current = env
    while _is_legacy_gym_class(type(current)) and hasattr(current, "env"):
        cls = type(current)
        if cls.__name__ == "PassiveEnvChecker" and cls.__module__.startswith("gym.wrappers"):
            if outer is None:
                env = current.env
            else:
                outer.env = current.env
        else:
            outer = current
        current = current.env
    return env


class LegacyEnv(gymnasium.Env[Any, Any]):
    """An env of the legacy gym API seen through Gymnasium's.

    Converts ``reset()`` returning only the observation (seeded through ``env.seed``) and
    ``step`` returning ``(obs, reward, done, info)``: ``done`` becomes ``truncated`` when
    ``info["TimeLimit.truncated"]`` is true, else ``terminated`` (the key is removed from
    ``info``, as Gymnasium's and Shimmy's converters do). Spaces of the ``gym`` package are
    converted to Gymnasium's. Attributes the adapter lacks are read from the legacy env.

    Args:
        env: the legacy env.
        takes_seed: its ``reset`` accepts ``seed`` (gym 0.22-0.26 style); else it is seeded
            through ``env.seed(seed)`` (gym 0.21 style).
    """

    def __init__(self, env: Any, *, takes_seed: bool | None = None) -> None:
        self.legacy_env = env
        self._takes_seed = _reset_takes_seed(env) if takes_seed is None else takes_seed
        self.observation_space = convert_space(env.observation_space)
        self.action_space = convert_space(env.action_space)
        metadata = getattr(env, "metadata", None)
        self.metadata = dict(metadata) if isinstance(metadata, Mapping) else {"render_modes": []}
        modes = self.metadata.get("render_modes") or self.metadata.get("render.modes") or []
        self.metadata.setdefault("render_modes", list(modes))
        if self._takes_seed:
            self.render_mode = getattr(env, "render_mode", None)
        else:  # gym 0.21 chose the mode per render() call: a worker can only return frames
            self.render_mode = "rgb_array" if "rgb_array" in modes else None
        reward_range = getattr(env, "reward_range", None)
        if reward_range is not None:
            self.reward_range = reward_range

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        env = self.legacy_env
        if not self._takes_seed:
            if seed is not None:
                seeder = getattr(env, "seed", None)
                if callable(seeder):
                    seeder(seed)
                else:
                    gymnasium.logger.warn(
                        f"{type(env).__name__} has no seed() method: reset(seed={seed}) ignored"
                    )
            if options:
                gymnasium.logger.warn(
                    f"{type(env).__name__}.reset takes no options: options={options} ignored"
                )
            return env.reset(), {}
        kwargs: dict[str, Any] = {"seed": seed}
        if options is not None:
            kwargs["options"] = options
        try:
            parameters = inspect.signature(env.reset).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        if "return_info" in parameters:  # gym 0.22-0.25 returned only obs unless asked
            kwargs["return_info"] = True
        obs, info = env.reset(**kwargs)
        return obs, dict(info)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        result = tuple(self.legacy_env.step(action))
        if len(result) == 5:
            obs, reward, terminated, truncated, info = result
            return obs, reward, bool(terminated), bool(truncated), dict(info)
        if len(result) != 4:
            raise ValueError(
                f"{type(self.legacy_env).__name__}.step returned {len(result)} values, expected "
                "4 (obs, reward, done, info) or 5 (obs, reward, terminated, truncated, info)"
            )
        obs, reward, done, info = result
        info = dict(info)
        truncated = bool(done) and bool(info.pop("TimeLimit.truncated", False))
        return obs, reward, bool(done) and not truncated, truncated, info

    def render(self) -> Any:
        if self._takes_seed:
            return self.legacy_env.render()
        if self.render_mode is None:
            return None
        return self.legacy_env.render(mode=self.render_mode)

    def close(self) -> None:
        closer = getattr(self.legacy_env, "close", None)
        if callable(closer):
            closer()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "legacy_env":
            raise AttributeError(name)
        return getattr(self.legacy_env, name)

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        """Set ``name`` on the legacy env when it has it (else on this adapter when ``force``)."""
        if name not in self.__dict__ and hasattr(self.legacy_env, name):
            setattr(self.legacy_env, name, value)
            return True
        return bool(super().set_wrapper_attr(name, value, force=force))

    def __str__(self) -> str:
        return f"<{type(self).__name__}<{self.legacy_env}>>"


def convert_space(space: Any) -> spaces.Space[Any]:
    """A Gymnasium space equal to a ``gym`` space (a Gymnasium space is returned as is).

    Matches the legacy classes by name, so ``gym`` need not be importable here.
    """
    if isinstance(space, spaces.Space):
        return space
    kind = type(space).__name__
    if kind == "Discrete":
        return spaces.Discrete(int(space.n), start=int(getattr(space, "start", 0)))
    if kind == "Box":
        return spaces.Box(low=space.low, high=space.high, shape=space.shape, dtype=space.dtype)
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(np.asarray(space.nvec))
    if kind == "MultiBinary":
        return spaces.MultiBinary(space.n)
    if kind == "Tuple":
        return spaces.Tuple(tuple(convert_space(s) for s in space.spaces))
    if kind == "Dict":
        return spaces.Dict({key: convert_space(s) for key, s in space.spaces.items()})
    raise TypeError(
        f"cannot convert the legacy space {space!r} to a Gymnasium space: "
        "give the env Gymnasium spaces (gymnasium.spaces)"
    )
