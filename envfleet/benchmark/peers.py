"""Runners over optional peer libraries: Stable-Baselines3, EnvPool and PufferLib (each used
only if it is installed)."""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
import psutil

from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import Runner, Timing, Workload, _open_vector
from envfleet.spec import EnvSpec


@contextlib.contextmanager
def _quiet() -> Any:
    """Swallow what an import prints (the legacy ``gym`` package prints a notice on import)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def _stacked_actions(n: int, timing: Timing) -> Callable[[Any], list[Any]]:
    """Action batches for peers whose ``action_space`` is one env's: ``n`` samples stacked."""

    def actions(vec: Any) -> list[Any]:
        space = vec.action_space
        space.seed(timing.seed)
        return [
            np.stack([np.asarray(space.sample()) for _ in range(n)])
            for _ in range(timing.action_batches)
        ]

    return actions


def open_sb3(workload: Workload, timing: Timing) -> Runner:
    """Stable-Baselines3's ``SubprocVecEnv``: one process per env (its default start method)."""
    with _quiet():
        from stable_baselines3.common.vec_env import SubprocVecEnv

    def reset(vec: Any) -> None:
        vec.seed(timing.seed)
        vec.reset()

    n = workload.num_envs
    return _open_vector(
        "sb3",
        lambda: SubprocVecEnv([workload.factory()] * n),
        timing,
        reset=reset,
        actions=_stacked_actions(n, timing),
        info=lambda _: {"processes": n},
    )


def envpool_id(spec: EnvSpec) -> str | None:
    """The id EnvPool ships for ``spec``'s env (``ALE/Pong-v5`` is ``Pong-v5``), if any."""
    if not isinstance(spec.target, str) or spec.kwargs or spec.legacy_gym or spec.wrappers:
        return None
    import envpool

    shipped = set(envpool.list_all_envs())
    target = spec.target
    for candidate in (target, target.removeprefix("ALE/")):
        if candidate in shipped:
            return candidate
    return None


def _envpool_check(spec: EnvSpec) -> str | None:
    if envpool_id(spec) is None:
        return f"EnvPool does not ship {spec.name}"
    return None


def open_envpool(workload: Workload, timing: Timing) -> Runner:
    """EnvPool's implementation of the id (synchronous mode, its default thread count)."""
    import envpool

    shipped = envpool_id(workload.spec)
    if shipped is None:
        raise ValueError(f"EnvPool does not ship {workload.label}")
    task: str = shipped
    n = workload.num_envs

    class Vec:  # the runner interface over EnvPool's (gymnasium-type) env
        def __init__(self) -> None:
            # EnvPool rebuilds its observation space on every step, and Gymnasium warns about
            # the bounds' dtype: quiet Gymnasium's warnings while this runner is open.
            self._warn_level = gymnasium.logger.min_level
            gymnasium.logger.min_level = gymnasium.logger.ERROR
            try:
                self.env = envpool.make(task, env_type="gymnasium", num_envs=n, seed=timing.seed)
            except BaseException:
                gymnasium.logger.min_level = self._warn_level
                raise
            self.num_envs = n
            self.action_space = self.env.action_space

        def reset(self, seed: int | None = None) -> Any:
            return self.env.reset()

        def step(self, actions: Any) -> Any:
            return self.env.step(actions)

        def close(self) -> None:
            try:
                close = getattr(self.env, "close", None)
                if close is not None:
                    close()
            finally:
                gymnasium.logger.min_level = self._warn_level

    return _open_vector(
        "envpool",
        Vec,
        timing,
        actions=_stacked_actions(n, timing),
        info=lambda _: {"envpool_id": task},
    )


def puffer_env(spec: EnvSpec, *args: Any, buf: Any = None, **kwargs: Any) -> Any:
    """``spec``'s env in PufferLib's ``GymnasiumPufferEnv`` (its vector envs need one)."""
    import pufferlib.emulation

    if buf is None:
        return pufferlib.emulation.GymnasiumPufferEnv(env=spec.build())
    return pufferlib.emulation.GymnasiumPufferEnv(env=spec.build(), buf=buf)


def _puffer_workers(num_envs: int) -> int:
    """Workers for PufferLib: a divisor of ``num_envs`` (it needs one), one per core but one.

    PufferLib's workers and its main process busy-wait for each other: with a worker on every
    core the main process has none left, and on a small machine throughput collapses.
    """
    cores = min(len(usable_cpus()), psutil.cpu_count(logical=False) or len(usable_cpus()))
    most = max(1, min(cores - 1, num_envs))
    return max(w for w in range(1, most + 1) if num_envs % w == 0)


def open_pufferlib(workload: Workload, timing: Timing) -> Runner:
    """PufferLib's ``Multiprocessing`` vector env over ``GymnasiumPufferEnv``-wrapped envs."""
    import pufferlib.vector

    workers = _puffer_workers(workload.num_envs)
    return _open_vector(
        "pufferlib",
        lambda: pufferlib.vector.make(
            functools.partial(puffer_env, workload.spec),
            backend=pufferlib.vector.Multiprocessing,
            num_envs=workload.num_envs,
            num_workers=workers,
        ),
        timing,
        info=lambda _: {"workers": workers},
    )
