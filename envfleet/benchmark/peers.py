"""Runners over optional peer libraries: Stable-Baselines3, EnvPool, PufferLib and ale-py's
C++ ``AtariVectorEnv`` (each used only if it is installed), alone or hosted by envfleet's
workers. EnvPool and PufferLib also step by batch (``batch_size``) for the scripts' async
rows."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import psutil

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import CallRunner, Runner, Timing, Workload, cycle, open_vector
from envfleet.benchmark.base import sample_actions as _sample
from envfleet.spec import EnvSpec
from envfleet.threads import split_ids


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Swallow what an import prints (the legacy ``gym`` package prints a notice on import)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def version(package: str) -> str | None:
    """The installed version of ``package``, or ``None``."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def open_sb3(
    workload: Workload, timing: Timing, policy: Callable[[Any], Any] | None = None
) -> Runner:
    """Stable-Baselines3's ``SubprocVecEnv``: one process per env (its default start method)."""
    with quiet():
        from stable_baselines3.common.vec_env import SubprocVecEnv

    def reset(vec: Any) -> Any:
        vec.seed(timing.seed)
        return vec.reset()

    n = workload.num_envs
    fns = [workload.factory()] * n
    build = functools.partial(SubprocVecEnv, fns)
    return open_vector("sb3", build, timing, reset=reset, policy=policy, processes=n)


def envpool_id(spec: EnvSpec) -> str | None:
    """The id EnvPool ships for ``spec``'s env (``ALE/Pong-v5`` is ``Pong-v5``), if any."""
    if not isinstance(spec.target, str) or spec.kwargs or spec.legacy_gym or spec.wrappers:
        return None
    import envpool

    shipped = set(envpool.list_all_envs())
    for candidate in (spec.target, spec.target.removeprefix("ALE/")):
        if candidate in shipped:
            return candidate
    return None


def envpool_check(spec: EnvSpec) -> str | None:
    return None if envpool_id(spec) is not None else f"EnvPool does not ship {spec.name}"


class QuietEnvPool:
    """EnvPool's env with Gymnasium's warnings off while it is open (it rebuilds its
    observation space on every step, and Gymnasium warns about the bounds' dtype)."""

    def __init__(self, task: str, num_envs: int, **kwargs: Any) -> None:
        import envpool

        self._level = gymnasium.logger.min_level
        gymnasium.logger.min_level = gymnasium.logger.ERROR
        try:
            self.env = envpool.make(task, env_type="gymnasium", num_envs=num_envs, **kwargs)
        except BaseException:
            gymnasium.logger.min_level = self._level
            raise
        self.num_envs, self.action_space = num_envs, self.env.action_space

    def __getattr__(self, name: str) -> Any:  # reset, step, async_reset, send, recv
        return getattr(self.env, name)

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            gymnasium.logger.min_level = self._level


def open_envpool(
    workload: Workload,
    timing: Timing,
    *,
    task: str | None = None,
    batch_size: int | None = None,
    policy: Callable[[Any], Any] | None = None,
    **options: Any,
) -> Runner:
    """EnvPool's own implementation of the id (or of ``task``, with ``options``): stepped
    whole, or by ``batch_size`` envs, by ``policy`` if given; its default thread count unless
    ``options`` say."""
    shipped = task or envpool_id(workload.spec)
    if shipped is None:
        raise ValueError(f"EnvPool does not ship {workload.label}")
    n = workload.num_envs
    batch = {"batch_size": batch_size} if batch_size else {}
    return open_vector(
        "envpool",
        lambda: QuietEnvPool(shipped, n, seed=timing.seed, **batch, **options),
        timing,
        batch=batch_size,
        reset=lambda vec: vec.reset() if batch_size in (None, n) else vec.async_reset(),
        policy=policy,
        envpool_id=shipped,
        **batch,
        **options,
    )


def puffer_env(spec: EnvSpec, *args: Any, buf: Any = None, **kwargs: Any) -> Any:
    """``spec``'s env in PufferLib's ``GymnasiumPufferEnv`` (its vector envs need one)."""
    import pufferlib.emulation

    extra = {} if buf is None else {"buf": buf}  # its default, unless given
    return pufferlib.emulation.GymnasiumPufferEnv(env=spec.build(), **extra)


def _puffer_workers(num_envs: int) -> int:
    """Workers for PufferLib: a divisor of ``num_envs`` (it needs one), one per core but one.

    PufferLib's workers and its main process busy-wait for each other: with a worker on every
    core the main process has none left, and on a small machine throughput collapses.
    """
    cores = min(len(usable_cpus()), psutil.cpu_count(logical=False) or len(usable_cpus()))
    most = max(1, min(cores - 1, num_envs))
    return max(w for w in range(1, most + 1) if num_envs % w == 0)


PUFFER_SETTLE_S = 0.7
"""PufferLib's idle workers spin for 0.5 s before they start sleeping between polls."""


def open_pufferlib(
    workload: Workload,
    timing: Timing,
    *,
    num_workers: int | None = None,
    batch_size: int | None = None,
) -> Runner:
    """PufferLib's ``Multiprocessing`` vector env over ``GymnasiumPufferEnv``-wrapped envs
    (``recv`` + ``send``; every env per call unless ``batch_size``)."""
    with quiet():  # the old ``gym`` it imports prints a notice
        import pufferlib.vector

    n = workload.num_envs
    workers, batch = num_workers or _puffer_workers(n), batch_size or n
    # overwork: more workers than cores is allowed, the point of a comparison.
    vec = pufferlib.vector.make(
        functools.partial(puffer_env, workload.spec),
        backend=pufferlib.vector.Multiprocessing,
        num_envs=n,
        num_workers=workers,
        batch_size=batch,
        overwork=True,
    )
    try:
        actions = _sample(vec.single_action_space, batch, timing)
        vec.async_reset(timing.seed)

        def recv_send(acts: Any) -> None:
            vec.recv()
            vec.send(acts)

        advance = cycle(recv_send, actions, batch)
        return CallRunner(
            "pufferlib",
            advance,
            vec.close,
            timing,
            settle_s=PUFFER_SETTLE_S,
            workers=workers,
            batch_size=batch,
            pufferlib=version("pufferlib-core") or version("pufferlib"),
        )
    except BaseException:
        vec.close()
        raise


AS_ALE_V5 = dict(
    stack_num=1,
    img_height=210,
    img_width=160,
    grayscale=False,
    maxpool=False,
    noop_max=0,
    reward_clipping=False,
    use_fire_reset=False,
)
"""``AtariVectorEnv`` options that give ``gymnasium.make("ALE/...-v5")``'s observations: raw
210x160 RGB frames, no stack, pooling, no-ops, clipping or fire at reset (frame skip, sticky
actions and episode length come from the id's registration)."""


def ale_vector_options(spec: EnvSpec) -> dict[str, Any] | None:
    """``AtariVectorEnv`` options that step ``spec``'s env as Gymnasium's ALE env does (same
    game, frames and frame skip), or ``None`` when it is not a plain ``ALE/...`` id with RGB
    observations."""
    if not isinstance(spec.target, str) or not spec.target.startswith("ALE/"):
        return None
    if spec.legacy_gym or spec.wrappers:
        return None
    import ale_py

    gymnasium.register_envs(ale_py)
    kwargs = {**gymnasium.spec(spec.target).kwargs, **spec.kwargs}
    if kwargs.get("obs_type", "rgb") != "rgb" or not isinstance(kwargs.get("frameskip"), int):
        return None
    same = ("repeat_action_probability", "frameskip", "full_action_space")
    return {
        "game": kwargs["game"],
        "max_num_frames_per_episode": kwargs.get("max_num_frames_per_episode", 108_000),
        **{key: kwargs[key] for key in same if key in kwargs},
        **AS_ALE_V5,
    }


def ale_vector_check(spec: EnvSpec) -> str | None:
    if ale_vector_options(spec) is None:
        return f"{spec.name} is not an ALE id with RGB frames and a fixed frame skip"
    return None


def ale_vector(spec: EnvSpec, num_envs: int) -> Any:
    """ale-py's C++ ``AtariVectorEnv`` of ``num_envs`` (one thread per usable core), configured
    by :func:`ale_vector_options` to step the same frames as ``spec``'s id."""
    from ale_py.vector_env import AtariVectorEnv

    options = ale_vector_options(spec)
    if options is None:
        raise ValueError(str(ale_vector_check(spec)))
    game = options.pop("game")
    return AtariVectorEnv(game, num_envs, num_threads=len(usable_cpus()), **options)


def open_ale_vector(workload: Workload, timing: Timing) -> Runner:
    """:func:`ale_vector` of the workload's envs, alone in this process."""
    build = functools.partial(ale_vector, workload.spec, workload.num_envs)
    threads = len(usable_cpus())
    return open_vector("ale-vector", build, timing, threads=threads, ale_py=version("ale-py"))


def ale_hosted_fns(spec: EnvSpec, num_envs: int, parts: int) -> list[Callable[[], Any]]:
    """``vector_env_fns`` for envfleet to host what :func:`open_ale_vector` steps: ``num_envs``
    envs in ``parts`` consecutive blocks (fewer when there are fewer envs), each an
    ``AtariVectorEnv`` on one thread configured by :func:`ale_vector_options`."""
    from ale_py.vector_env import AtariVectorEnv

    options = ale_vector_options(spec)
    if options is None:
        raise ValueError(str(ale_vector_check(spec)))
    game = options.pop("game")
    return [
        functools.partial(AtariVectorEnv, game, len(block), num_threads=1, **options)
        for block in split_ids(range(num_envs), parts)
    ]


def open_ale_hosted(workload: Workload, timing: Timing) -> Runner:
    """envfleet hosting what :func:`open_ale_vector` steps: a worker process per usable core
    (at most one per env), each hosting an ``AtariVectorEnv`` of its block of envs on one
    thread (:func:`ale_hosted_fns`): the same frames, and ale-vector's threads in all."""
    fns = ale_hosted_fns(workload.spec, workload.num_envs, len(usable_cpus()))
    return open_vector(
        "ale-hosted",
        lambda: envfleet.make(vector_env_fns=fns, backend="process"),
        timing,
        workers=len(fns),
        threads=len(fns),
        ale_py=version("ale-py"),
    )


__all__ = [
    "ale_hosted_fns",
    "ale_vector",
    "ale_vector_options",
    "open_envpool",
    "open_sb3",
    "quiet",
    "version",
]
