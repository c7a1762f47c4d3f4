"""Legacy ``gym`` environments, converted to Gymnasium's API at the edge of :mod:`envfleet.spec`.

An id missing from Gymnasium's registry is looked up in the legacy ``gym`` registry
(:func:`in_legacy_gym_registry`, :func:`legacy_gym_make`), and an env of the old API (a
``gym.Env``, or any object with the old ``reset``/``step``) is wrapped into a
``gymnasium.Env`` by :func:`as_gymnasium`: through Shimmy's compatibility wrappers where they
apply, else :class:`LegacyEnv`, with its spaces converted (:func:`convert_space`). Nothing
above :mod:`envfleet.spec` knows about them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import sys
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


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


def in_legacy_gym_registry(env_id: str) -> bool:
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


def legacy_gym_make(env_id: str, kwargs: Mapping[str, Any]) -> Any:
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

    wrapper: Callable[..., gymnasium.Env[Any, Any]] = (
        GymV26CompatibilityV0 if takes_seed else GymV21CompatibilityV0
    )
    return wrapper


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
            asks_for_info = "return_info" in inspect.signature(env.reset).parameters
        except (TypeError, ValueError):
            asks_for_info = False
        if asks_for_info:  # gym 0.22-0.25 returned only obs unless asked
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


__all__ = [
    "LegacyEnv",
    "as_gymnasium",
    "convert_space",
    "in_legacy_gym_registry",
    "is_legacy_env",
    "legacy_gym_make",
]
