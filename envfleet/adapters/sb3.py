"""Stable-Baselines3 adapter: an envfleet pool behind SB3's ``VecEnv`` interface.

>>> import numpy as np
>>> from envfleet.adapters.sb3 import make_sb3
>>> venv = make_sb3("CartPole-v1", num_envs=4, backend="serial", seed=0)
>>> obs = venv.reset()
>>> obs, rewards, dones, infos = venv.step(np.zeros(4, dtype=np.int64))
>>> obs.shape, rewards.tolist(), dones.tolist(), infos[0]
((4, 4), [1.0, 1.0, 1.0, 1.0], [False, False, False, False], {'TimeLimit.truncated': False})
>>> venv.close()

SB3 resets an env in the step that ends its episode, so the pool must use Gymnasium's
``SAME_STEP`` autoreset mode. Its infos (a dict of arrays, with ``final_obs`` and
``final_info`` for the envs that ended) become SB3's list of one dict per env: the ended
episode's info with ``terminal_observation``, ``TimeLimit.truncated`` on every step, and
``episode`` when a ``RecordEpisodeStatistics``-like wrapper reported one; the info of the reset
that started the next episode goes to :attr:`VecEnv.reset_infos`, as in SB3's own VecEnvs.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array

try:
    from stable_baselines3.common.vec_env import VecEnv as _Sb3VecEnv
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "envfleet.sb3 needs Stable-Baselines3: pip install 'envfleet[sb3]'", name=exc.name
    ) from exc

from envfleet._make import make
from envfleet.adapters._sb3_bridge import IS_BRIDGED, SELECTED, Sb3Bridge
from envfleet.errors import EnvError
from envfleet.pool import Pool
from envfleet.spec import EnvSpec, EnvWrapper

AnyWrapper = gymnasium.Wrapper[Any, Any, Any, Any]

FINAL_OBS = "final_obs"
FINAL_INFO = "final_info"
TERMINAL_OBSERVATION = "terminal_observation"
TIME_LIMIT_TRUNCATED = "TimeLimit.truncated"


class VecEnv(_Sb3VecEnv):
    """SB3's ``VecEnv`` over an envfleet :class:`~envfleet.Pool`.

    Args:
        pool: a pool made with ``autoreset_mode=AutoresetMode.SAME_STEP`` and
            ``batch_size=None`` (every env in every step). The adapter owns it: :meth:`close`
            closes it.

    ``env_method`` and ``set_attr`` on some envs only (``indices``), and an exact
    ``env_is_wrapped`` (``isinstance`` through the wrapper chain), need each env wrapped in a
    bridge wrapper, which :func:`make_sb3` adds. On a pool made otherwise, those calls on a
    subset raise ``NotImplementedError`` and ``env_is_wrapped`` compares class names.
    """

    def __init__(self, pool: Pool) -> None:
        if not isinstance(pool, Pool):
            raise TypeError(f"VecEnv wraps an envfleet Pool, got {type(pool).__name__}")
        if pool.autoreset_mode is not AutoresetMode.SAME_STEP:
            raise ValueError(
                "Stable-Baselines3 resets an env in the step that ends its episode: make the pool "
                f"with autoreset_mode=AutoresetMode.SAME_STEP (got {pool.autoreset_mode}), "
                "or use make_sb3"
            )
        if pool.batch_size != pool.num_envs:
            raise ValueError(
                f"Stable-Baselines3 steps every env at once: the pool's batch_size "
                f"({pool.batch_size}) must equal num_envs ({pool.num_envs})"
            )
        self.pool = pool
        self.waiting = False
        self.closed = False
        super().__init__(pool.num_envs, pool.single_observation_space, pool.single_action_space)
        self._bridged = self.has_attr(IS_BRIDGED)

    # -- stepping ------------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds of :meth:`seed` and options of :meth:`set_options`."""
        if self.waiting:  # a step in flight is cancelled: take its results and drop them
            self.pool.recv()
            self.waiting = False
        seeds: list[int | None] = list(self._seeds)
        seed_arg = seeds if any(s is not None for s in seeds) else None
        groups = _group_by_options(self._options)
        obs: VecEnvObs  # every env is in one of the groups, so a reset sets it
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for options, ids in groups:
            if len(groups) == 1:
                obs, batched = self.pool.reset(seed=seed_arg, options=options or None)
            else:
                mask = np.zeros(self.num_envs, dtype=np.bool_)
                mask[ids] = True
                obs, batched = self.pool.reset(
                    seed=seed_arg, options={**options, "reset_mask": mask}
                )
            unbatched = unbatch_infos(batched, self.num_envs)
            for i in ids:
                infos[i] = unbatched[i]
        self.reset_infos = infos
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        space = self.pool.single_action_space
        if isinstance(actions, list) and isinstance(space, spaces.Dict | spaces.Tuple):
            # One action per env, as SB3's own VecEnvs take them: batch them for the pool.
            out = create_empty_array(space, len(actions), fn=np.zeros)
            actions = concatenate(space, actions, out)
        self.pool.send(actions)
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, terminations, truncations, infos = self.pool.recv()
        self.waiting = False
        infos.pop("env_id", None)
        step_infos, reset_infos = to_sb3_infos(infos, terminations, truncations)
        for i, reset_info in reset_infos.items():
            self.reset_infos[i] = reset_info
        dones = np.logical_or(terminations, truncations)
        return obs, np.array(rewards), dones, step_infos

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.waiting = False
        self.pool.close()

    # -- attributes and methods of the envs ----------------------------------------------------

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """Attribute ``attr_name`` of each env (a method comes back uncalled, as in SB3)."""
        values = self._call("get_wrapper_attr", (attr_name,), {})
        return [values[i] for i in self._get_indices(indices)]

    def has_attr(self, attr_name: str) -> bool:
        return all(self._call("has_wrapper_attr", (attr_name,), {}))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        targets = self._targets(indices, "set_attr")
        if targets is None:
            self.pool.set_attr(attr_name, [value] * self.num_envs)
        else:
            self._select(targets)
            self._call("envfleet_sb3_set_attr", (attr_name, value), {})

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        targets = self._targets(indices, "env_method")
        if targets is None:
            return list(self._call(method_name, method_args, method_kwargs))
        self._select(targets)
        call = (method_name, method_args, method_kwargs)
        results = self._call("envfleet_sb3_env_method", call, {})
        return [results[i][1] for i in targets]

    def env_is_wrapped(
        self, wrapper_class: type[AnyWrapper], indices: VecEnvIndices = None
    ) -> list[bool]:
        if self._bridged:
            flags = self._call("envfleet_sb3_is_wrapped", (wrapper_class,), {})
        else:  # without the bridge, only the wrapper chain's class names can be seen
            flags = tuple(
                wrapper_class.__name__ in re.findall(r"<(\w+)", text)
                for text in self._call("__str__", (), {})
            )
        return [bool(flags[i]) for i in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but get_images() needs 'rgb_array'",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return list(self.pool.render() or [None] * self.num_envs)

    # -- internals -----------------------------------------------------------------------------

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``pool.call``, with an env's ``AttributeError`` raised as one (SB3's ``has_attr``)."""
        try:
            return self.pool.call(name, *args, **kwargs)
        except EnvError as exc:
            if isinstance(exc.__cause__, AttributeError):
                raise AttributeError(str(exc)) from exc
            raise

    def _targets(self, indices: VecEnvIndices, what: str) -> list[int] | None:
        """The env indices of a call, or ``None`` when it covers every env."""
        targets = [int(i) % self.num_envs for i in self._get_indices(indices)]
        if sorted(set(targets)) == list(range(self.num_envs)):
            return None
        if not self._bridged:
            raise NotImplementedError(
                f"{what} on some envs only (indices={targets}) needs envs wrapped by "
                "envfleet.adapters.sb3.make_sb3; this pool can only reach every env at once"
            )
        return targets

    def _select(self, targets: Iterable[int]) -> None:
        wanted = set(targets)
        self.pool.set_attr(SELECTED, [i in wanted for i in range(self.num_envs)])

    def __repr__(self) -> str:
        return f"envfleet.adapters.sb3.VecEnv({self.pool!r})"


def make_sb3(
    env: Any,
    num_envs: int | None = None,
    *,
    wrappers: Sequence[EnvWrapper] = (),
    env_kwargs: dict[str, Any] | None = None,
    start_method: str | None = None,
    **make_kwargs: Any,
) -> VecEnv:
    """:func:`envfleet.make` for Stable-Baselines3: a :class:`VecEnv` over a new pool.

    Args:
        env: what :func:`envfleet.make` takes (an id, an env class or a factory), or one per
            env (``env_fns``, as SB3's ``SubprocVecEnv(env_fns)``: env ``i`` is ``env_fns[i]()``).
        num_envs: number of envs (``None``: one per entry of ``env_fns``).
        wrappers: applied to each env in its worker, in order (``Monitor``,
            ``RecordEpisodeStatistics``...), after the env's own.
        env_kwargs: keyword arguments for ``gymnasium.make`` or the factory.
        start_method: ``SubprocVecEnv``'s name for :func:`envfleet.make`'s ``context`` (the
            process backend's multiprocessing start method).
        **make_kwargs: other :func:`envfleet.make` arguments (``backend``, ``num_workers``,
            ``seed``...); ``autoreset_mode`` is ``AutoresetMode.SAME_STEP`` and ``batch_size`` is
            ``num_envs``.
    """
    mode = make_kwargs.pop("autoreset_mode", AutoresetMode.SAME_STEP)
    if mode not in (AutoresetMode.SAME_STEP, AutoresetMode.SAME_STEP.value):
        raise ValueError(f"make_sb3 needs autoreset_mode=AutoresetMode.SAME_STEP, got {mode!r}")
    batch_size = make_kwargs.pop("batch_size", None)
    if batch_size is not None and batch_size != (num_envs or EnvSpec.from_user(env).num_envs):
        raise ValueError(f"make_sb3 steps every env at once: batch_size={batch_size} not allowed")
    if start_method is not None:
        if make_kwargs.get("context") not in (None, start_method):
            raise ValueError(
                f"start_method={start_method!r} and context={make_kwargs['context']!r} name the "
                "same thing: give one"
            )
        make_kwargs["context"] = start_method
    # Every field of the recipe is kept (a per-env list, the registry entry an id resolved to):
    # only the wrappers grow, on every env.
    spec = EnvSpec.from_user(env, env_kwargs).wrapped([*wrappers, Sb3Bridge])
    pool = make(spec, num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **make_kwargs)
    try:
        return VecEnv(pool)
    except BaseException:
        pool.close()
        raise


def unbatch_infos(infos: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Gymnasium's vector infos (arrays with ``_key`` masks) as one dict per env."""
    out: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in infos.items():
        if key.startswith("_") and key[1:] in infos:
            continue  # a mask
        mask = infos.get(f"_{key}")
        rows = unbatch_infos(value, num_envs) if isinstance(value, dict) else None
        for i in range(num_envs):
            if mask is not None and not mask[i]:
                continue
            out[i][key] = rows[i] if rows is not None else _item(value[i])
    return out


def to_sb3_infos(
    infos: dict[str, Any], terminations: np.ndarray, truncations: np.ndarray
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """SB3's per-env step infos, and the reset infos of the envs that ended, from a
    ``SAME_STEP`` pool's infos."""
    num_envs = len(terminations)
    per_env = unbatch_infos(infos, num_envs)
    step_infos: list[dict[str, Any]] = []
    reset_infos: dict[int, dict[str, Any]] = {}
    for i, info in enumerate(per_env):
        if FINAL_OBS in info:
            final_obs = info.pop(FINAL_OBS)
            step_info = dict(info.pop(FINAL_INFO, None) or {})
            # A vector-level RecordEpisodeStatistics reports the episode next to the reset info.
            if "episode" in info:
                step_info.setdefault("episode", info.pop("episode"))
            reset_infos[i] = info
            step_info[TERMINAL_OBSERVATION] = final_obs
        else:
            step_info = info
        step_info[TIME_LIMIT_TRUNCATED] = bool(truncations[i] and not terminations[i])
        step_infos.append(step_info)
    return step_infos, reset_infos


def _group_by_options(options: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    groups: list[tuple[dict[str, Any], list[int]]] = []
    for i, option in enumerate(options):
        for existing, ids in groups:
            if existing == option:
                ids.append(i)
                break
        else:
            groups.append((option or {}, [i]))
    return groups


_PYTHON_SCALAR_DTYPES = (np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.float64))
"""The dtypes the batched infos give Python ``bool``, ``int`` and ``float`` values."""


def _item(value: Any) -> Any:
    """One env's info value as the env gave it, as SB3's ``SubprocVecEnv`` hands it over.

    Batching made a Python ``bool``/``int``/``float`` a numpy scalar of a default dtype: it
    becomes a Python scalar again. Numpy scalars of other dtypes (``np.float32``, ``np.int32``,
    ``np.uint8``, ...) are what the env returned, and stay so. (An ``np.float64`` or
    ``np.int64`` the env returned comes back as a Python number: batching cannot tell them
    apart, and both compare and compute alike.)
    """
    if isinstance(value, np.generic) and value.dtype in _PYTHON_SCALAR_DTYPES:
        return value.item()
    return value


__all__ = ["VecEnv", "make_sb3", "to_sb3_infos", "unbatch_infos"]
