"""Side-by-side throughput benchmark: the engine behind ``envfleet bench``.

A *runner* is one way of stepping ``num_envs`` copies of an env: a plain for-loop, the
independent-processes ceiling, an envfleet backend or a peer library. It is opened with
``RUNNERS[name].open(workload, timing)``, which builds and resets its envs and warms up; each
:meth:`Runner.window` then steps for a given number of seconds and returns env-steps per second
(a vector step of ``n`` envs counts ``n``). Actions are random, sampled before the clock starts
and cycled, so sampling does not weigh on the result.

:func:`measure` opens several runners on one workload and interleaves their windows (window 1
of every runner, then window 2, ...), so a burst of load from elsewhere on the machine hits all
runners alike instead of one; the median window is what gets reported. :func:`sweep` does that
for each ``num_envs`` of a list and returns a :class:`Report`, which renders as a table
(:func:`report_table`), a plot (:func:`write_plot`) and JSON (:meth:`Report.as_dict`).

Runners:

- ``loop``: a Python for-loop over the envs in this process, resetting finished ones;
- ``ceiling``: the envs split over one process per usable core that never communicate, their
  throughputs summed: what parallel stepping could reach with no coordination at all;
- ``serial`` / ``process`` / ``thread``: ``envfleet.make`` with that backend (default workers);
- ``gym-sync`` / ``gym-async``: Gymnasium's ``SyncVectorEnv`` and
  ``AsyncVectorEnv(shared_memory=True)`` (one process per env);
- ``sb3``: Stable-Baselines3's ``SubprocVecEnv`` (one process per env), if it is installed;
- ``envpool``: EnvPool's own implementation of the id, if it is installed and ships the id
  (its defaults may differ from Gymnasium's: Atari preprocessing, for one);
- ``pufferlib``: PufferLib's ``Multiprocessing`` vector env, if it is installed (one worker per
  core but one, for its main process: both busy-wait).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import importlib.metadata
import io
import json
import math
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv
from rich.table import Table

import envfleet
from envfleet._make import usable_cores
from envfleet.spec import EnvSpec

CEILING_TIMEOUT = 600.0
"""Seconds the ceiling's processes and their parent wait for each other before giving up."""

LOOP = "loop"
CEILING = "ceiling"

# Runner statuses in a report.
OK = "ok"
FAILED = "failed"
PARTIAL = "partial"  # failed at some env counts only
NOT_INSTALLED = "not installed"
UNSUPPORTED = "unsupported"
UNAVAILABLE = "unavailable"  # installed, but importing it failed


@dataclass(frozen=True)
class Timing:
    """How long and how often to measure.

    Attributes:
        seconds: length of each timed window.
        warmup: seconds of stepping after building, before any window (not timed).
        rewarm: seconds of untimed stepping just before each window (caches, sleeping workers).
        repeats: timed windows per runner; the median is reported.
        seed: seeds env resets and action sampling.
        action_batches: pre-sampled action batches, cycled through.
    """

    seconds: float = 1.0
    warmup: float = 0.5
    rewarm: float = 0.2
    repeats: int = 3
    seed: int = 0
    action_batches: int = 256

    @classmethod
    def scaled(cls, seconds: float, repeats: int, seed: int = 0) -> Timing:
        """Windows of ``seconds``, with warm-ups in proportion when windows are short."""
        return cls(
            seconds=seconds,
            warmup=min(0.5, seconds),
            rewarm=min(0.2, seconds / 5),
            repeats=repeats,
            seed=seed,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "interleaved": True,
            "statistic": "median",
            "unit": "env-steps per second",
        }


def _build_env(spec: EnvSpec) -> gymnasium.Env[Any, Any]:
    return spec.build()


@dataclass(frozen=True)
class Workload:
    """What to step: an env and how many copies of it."""

    spec: EnvSpec
    num_envs: int

    @classmethod
    def of(cls, env: Any, num_envs: int, env_kwargs: dict[str, Any] | None = None) -> Workload:
        """``env`` as :func:`envfleet.make` takes it: an id, an env class or a factory."""
        return cls(EnvSpec.from_user(env, env_kwargs), num_envs)

    @property
    def label(self) -> str:
        return self.spec.name

    def build(self) -> gymnasium.Env[Any, Any]:
        return self.spec.build()

    def factory(self) -> Callable[[], gymnasium.Env[Any, Any]]:
        """A picklable zero-argument factory (for vector envs that start processes)."""
        return functools.partial(_build_env, self.spec)


@dataclass
class RunResult:
    """What one runner measured on one workload.

    Attributes:
        runner: runner name.
        throughputs: env-steps/s of each timed window.
        setup_s: seconds to build and reset the envs (before warm-up).
        info: runner-specific details (process counts, ...).
        other_load: per window, the cores kept busy by processes outside this benchmark's
            process tree (other users of the machine); near 0 when the numbers are clean.
    """

    runner: str
    throughputs: list[float]
    setup_s: float
    info: dict[str, Any] = field(default_factory=dict)
    other_load: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.throughputs)


# -- load from elsewhere ---------------------------------------------------------------------


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (``guest`` is already inside ``user``)."""
    t = psutil.cpu_times()
    return float(sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq")))


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its live descendants."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class OtherLoad:
    """Measures the cores used by processes outside this process tree over a stretch of time."""

    cores: float = 0.0

    def __enter__(self) -> OtherLoad:
        self.cores = 0.0
        self._start = (time.perf_counter(), _busy_cpu_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall, busy, own = self._start
        wall = time.perf_counter() - wall
        other = (_busy_cpu_s() - busy) - (_own_cpu_s() - own)
        self.cores = max(0.0, other / wall) if wall > 0 else 0.0


# -- runners ---------------------------------------------------------------------------------


def _time_loop(step: Callable[[Any], object], actions: Sequence[Any], seconds: float) -> float:
    """Call ``step`` with actions cycled from ``actions`` for ``seconds``; calls per second."""
    n = len(actions)
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        step(actions[calls % n])
        calls += 1
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


class Runner:
    """An open runner: its envs are built, reset and warmed up.

    Attributes:
        name: runner name.
        setup_s: seconds it took to build and reset the envs.
        info: runner-specific details for the results.
    """

    name: str
    setup_s: float
    info: dict[str, Any]

    def window(self, seconds: float) -> float:
        """Step for ``seconds`` (after ``timing.rewarm`` untimed); env-steps per second."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class LoopRunner(Runner):
    """Times ``step(actions[k])`` in this process; each call steps ``envs_per_call`` envs."""

    def __init__(
        self,
        name: str,
        step: Callable[[Any], object],
        actions: Sequence[Any],
        envs_per_call: int,
        timing: Timing,
        setup_s: float,
        close: Callable[[], object],
        **info: Any,
    ) -> None:
        self.name, self.setup_s, self.info = name, setup_s, info
        self._step, self._actions, self._envs_per_call = step, actions, envs_per_call
        self._rewarm = timing.rewarm
        self._close = close
        try:
            _time_loop(step, actions, timing.warmup)
        except BaseException:
            close()
            raise

    def window(self, seconds: float) -> float:
        _time_loop(self._step, self._actions, self._rewarm)
        return self._envs_per_call * _time_loop(self._step, self._actions, seconds)

    def close(self) -> None:
        self._close()


def _to_python(space: spaces.Space[Any], action: Any) -> Any:
    return int(action) if isinstance(space, spaces.Discrete) else action


def _for_loop(
    workload: Workload, count: int, timing: Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[list[Any]], list[gymnasium.Env[Any, Any]]]:
    """Build and reset ``count`` envs; return a sweep over them, its actions and the envs."""
    envs: list[gymnasium.Env[Any, Any]] = []
    try:
        for i in range(count):
            envs.append(workload.build())
            envs[-1].reset(seed=timing.seed + first_index + i)
        space = envs[0].action_space
        space.seed(timing.seed + first_index)
        actions = [
            [_to_python(space, space.sample()) for _ in range(count)]
            for _ in range(timing.action_batches)
        ]
    except BaseException:
        for env in envs:
            env.close()
        raise

    def sweep(batch: list[Any]) -> None:
        for env, action in zip(envs, batch, strict=True):
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()

    return sweep, actions, envs


def open_loop(workload: Workload, timing: Timing) -> Runner:
    """A Python for-loop over the envs in this process, resetting finished ones."""
    start = time.perf_counter()
    sweep, actions, envs = _for_loop(workload, workload.num_envs, timing)
    setup_s = time.perf_counter() - start

    def close() -> None:
        for env in envs:
            env.close()

    return LoopRunner(LOOP, sweep, actions, workload.num_envs, timing, setup_s, close)


def _ceiling_worker(
    workload: Workload,
    count: int,
    first_index: int,
    timing: Timing,
    go: Any,
    seconds: Any,
    results: Any,
    index: int,
) -> None:
    """Build ``count`` envs; at each ``go``, time a window of ``seconds.value`` (<= 0: stop)."""
    envs: list[gymnasium.Env[Any, Any]] = []
    try:
        sweep, actions, envs = _for_loop(workload, count, timing, first_index)
        results.put((index, "ready", None))
        while True:
            go.wait(CEILING_TIMEOUT)
            window = seconds.value
            if window <= 0:
                break
            _time_loop(sweep, actions, timing.rewarm)
            results.put((index, count * _time_loop(sweep, actions, window), None))
    except BaseException as exc:
        go.abort()
        results.put((index, None, f"{type(exc).__name__}: {exc}"))
    finally:
        for env in envs:
            env.close()


class CeilingRunner(Runner):
    """The envs split over one process per usable core, never communicating; throughputs summed.

    Each process runs the for-loop on its share; the parent only starts each window (a barrier)
    and adds up what the processes measured inside it.
    """

    def __init__(self, workload: Workload, timing: Timing) -> None:
        self.name = CEILING
        num_procs = min(usable_cores(), workload.num_envs)
        counts = [len(ids) for ids in np.array_split(np.arange(workload.num_envs), num_procs)]
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        self.info = {"processes": num_procs, "envs_per_process": counts}
        ctx = multiprocessing.get_context()
        self._go = ctx.Barrier(num_procs + 1)
        self._seconds = ctx.Value("d", 0.0)
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_ceiling_worker,
                args=(workload, counts[i], firsts[i], timing, self._go, self._seconds,
                      self._results, i),
                daemon=True,
            )
            for i in range(num_procs)
        ]  # fmt: skip
        start = time.perf_counter()
        for proc in self._procs:
            proc.start()
        try:
            self._gather()
            self.setup_s = time.perf_counter() - start
            self.window(timing.warmup)
        except BaseException:
            self.close()
            raise

    def _gather(self) -> list[Any]:
        values = []
        errors = []
        for _ in self._procs:
            _, value, error = self._results.get(timeout=CEILING_TIMEOUT)
            if error is None:
                values.append(value)
            else:
                errors.append(error)
        if errors:
            raise RuntimeError(f"a ceiling process failed: {errors[0]}")
        return values

    def window(self, seconds: float) -> float:
        self._seconds.value = seconds
        self._go.wait(CEILING_TIMEOUT)
        return float(sum(self._gather()))

    def close(self) -> None:
        self._seconds.value = 0.0
        try:
            self._go.wait(10.0)
        except Exception:
            pass  # broken by a failed process: terminated below
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._results.close()
        self._results.join_thread()


def open_ceiling(workload: Workload, timing: Timing) -> Runner:
    """See :class:`CeilingRunner`."""
    return CeilingRunner(workload, timing)


def _open_vector(
    name: str,
    build: Callable[[], Any],
    timing: Timing,
    *,
    reset: Callable[[Any], object] | None = None,
    actions: Callable[[Any], list[Any]] | None = None,
    info: Callable[[Any], dict[str, Any]] | None = None,
) -> LoopRunner:
    """A runner over a vector env: built, reset (``vec.reset(seed=...)`` by default), then
    stepped with ``vec.step(batch)``, batches from ``actions(vec)`` (by default, samples of
    ``vec.action_space``)."""
    start = time.perf_counter()
    vec = build()
    try:
        if reset is None:
            vec.reset(seed=timing.seed)
        else:
            reset(vec)
        setup_s = time.perf_counter() - start
        if actions is None:
            vec.action_space.seed(timing.seed)
            batches = [vec.action_space.sample() for _ in range(timing.action_batches)]
        else:
            batches = actions(vec)
        details = info(vec) if info is not None else {}
    except BaseException:
        vec.close()
        raise
    return LoopRunner(name, vec.step, batches, vec.num_envs, timing, setup_s, vec.close, **details)


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


def _envfleet(backend: str) -> Callable[[Workload, Timing], Runner]:
    def open_envfleet(workload: Workload, timing: Timing) -> Runner:
        return _open_vector(
            backend,
            lambda: envfleet.make(workload.spec, workload.num_envs, backend=backend),
            timing,
            info=lambda pool: {"workers": pool.num_workers},
        )

    open_envfleet.__doc__ = f'``envfleet.make(..., backend="{backend}")``, default workers.'
    return open_envfleet


def open_gym_sync(workload: Workload, timing: Timing) -> Runner:
    """Gymnasium's ``SyncVectorEnv``."""
    fns = [workload.factory()] * workload.num_envs
    return _open_vector("gym-sync", lambda: SyncVectorEnv(fns), timing)


def open_gym_async(workload: Workload, timing: Timing) -> Runner:
    """Gymnasium's ``AsyncVectorEnv(shared_memory=True)``: one process per env."""
    fns = [workload.factory()] * workload.num_envs
    return _open_vector(
        "gym-async",
        lambda: AsyncVectorEnv(fns, shared_memory=True),
        timing,
        info=lambda _: {"processes": workload.num_envs},
    )


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


def _puffer_env(spec: EnvSpec, *args: Any, buf: Any = None, **kwargs: Any) -> Any:
    import pufferlib.emulation

    if buf is None:
        return pufferlib.emulation.GymnasiumPufferEnv(env=spec.build())
    return pufferlib.emulation.GymnasiumPufferEnv(env=spec.build(), buf=buf)


def _puffer_workers(num_envs: int) -> int:
    """Workers for PufferLib: a divisor of ``num_envs`` (it needs one), one per core but one.

    PufferLib's workers and its main process busy-wait for each other: with a worker on every
    core the main process has none left, and on a small machine throughput collapses.
    """
    cores = min(usable_cores(), psutil.cpu_count(logical=False) or usable_cores())
    most = max(1, min(cores - 1, num_envs))
    return max(w for w in range(1, most + 1) if num_envs % w == 0)


def open_pufferlib(workload: Workload, timing: Timing) -> Runner:
    """PufferLib's ``Multiprocessing`` vector env over ``GymnasiumPufferEnv``-wrapped envs."""
    import pufferlib.vector

    workers = _puffer_workers(workload.num_envs)
    return _open_vector(
        "pufferlib",
        lambda: pufferlib.vector.make(
            functools.partial(_puffer_env, workload.spec),
            backend=pufferlib.vector.Multiprocessing,
            num_envs=workload.num_envs,
            num_workers=workers,
        ),
        timing,
        info=lambda _: {"workers": workers},
    )


@dataclass(frozen=True)
class RunnerKind:
    """A runner by name.

    Attributes:
        name: the name on the command line and in results.
        description: one line, for help and reports.
        open: builds, resets and warms it up on a workload.
        module: a module that must import for the runner to be available (a peer library).
        check: why an env cannot run on this runner, or ``None`` when it can.
    """

    name: str
    description: str
    open: Callable[[Workload, Timing], Runner]
    module: str | None = None
    check: Callable[[EnvSpec], str | None] | None = None


RUNNERS: dict[str, RunnerKind] = {
    kind.name: kind
    for kind in (
        RunnerKind(LOOP, "Python for-loop over the envs in this process", open_loop),
        RunnerKind(CEILING, "one independent process per core, throughputs summed", open_ceiling),
        RunnerKind("serial", "envfleet, serial backend", _envfleet("serial")),
        RunnerKind("process", "envfleet, process backend", _envfleet("process")),
        RunnerKind("thread", "envfleet, thread backend", _envfleet("thread")),
        RunnerKind("gym-sync", "Gymnasium SyncVectorEnv", open_gym_sync),
        RunnerKind("gym-async", "Gymnasium AsyncVectorEnv (shared memory)", open_gym_async),
        RunnerKind("sb3", "Stable-Baselines3 SubprocVecEnv", open_sb3, "stable_baselines3"),
        RunnerKind("envpool", "EnvPool", open_envpool, "envpool", _envpool_check),
        RunnerKind("pufferlib", "PufferLib Multiprocessing", open_pufferlib, "pufferlib.vector"),
    )
}
"""Every runner by name, in the order they are run and shown."""

ALIASES = {
    "for-loop": LOOP,
    "envfleet-serial": "serial",
    "envfleet-process": "process",
    "envfleet-thread": "thread",
}
"""Longer names (``envfleet-process``) also accepted by :func:`parse_runners`."""


def parse_runners(text: str) -> list[str]:
    """``"loop,process"`` as runner names (aliases resolved, duplicates dropped, in order).

    Raises:
        ValueError: a name is unknown, or none is given; the message lists the known ones.
    """
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        name = ALIASES.get(name, name)
        if name not in RUNNERS:
            raise ValueError(f"unknown runner {raw.strip()!r}: choose from {', '.join(RUNNERS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no runner given: choose from {', '.join(RUNNERS)}")
    return names


@contextlib.contextmanager
def _quiet() -> Any:
    """Swallow what an import prints (the legacy ``gym`` package prints a notice on import)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


@dataclass(frozen=True)
class Availability:
    """Whether a runner can run an env here, and why not."""

    status: str  # OK, NOT_INSTALLED, UNAVAILABLE or UNSUPPORTED
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK


def availability(name: str, spec: EnvSpec) -> Availability:
    """Whether runner ``name`` is installed here and can run ``spec``'s env."""
    kind = RUNNERS[name]
    if kind.module is not None:
        try:
            with _quiet():
                importlib.import_module(kind.module)
        except ModuleNotFoundError as exc:
            root = kind.module.split(".")[0]
            if exc.name is not None and (exc.name == root or kind.module.startswith(exc.name)):
                return Availability(NOT_INSTALLED, f"{root} is not installed")
            return Availability(UNAVAILABLE, f"importing {kind.module} failed: {exc}")
        except Exception as exc:
            return Availability(
                UNAVAILABLE, f"importing {kind.module} failed: {type(exc).__name__}: {exc}"
            )
    if kind.check is not None:
        try:
            reason = kind.check(spec)
        except Exception as exc:
            return Availability(UNAVAILABLE, f"{type(exc).__name__}: {exc}")
        if reason is not None:
            return Availability(UNSUPPORTED, reason)
    return Availability(OK)


# -- measuring -------------------------------------------------------------------------------


def measure(
    names: Sequence[str],
    workload: Workload,
    timing: Timing,
    *,
    on_error: Callable[[str, BaseException], object] | None = None,
    progress: Callable[[str], object] | None = None,
) -> dict[str, RunResult | str]:
    """Open the runners ``names`` on ``workload`` and time their windows, interleaved.

    Args:
        names: keys of :data:`RUNNERS` (available ones: see :func:`availability`).
        workload: what to step.
        timing: window length, warm-up and repeats.
        on_error: called with the runner name and the exception when a runner fails; the
            runner is then dropped and its entry in the result is the error message.
        progress: called with a short description of what starts next.

    Returns:
        For each name, its :class:`RunResult` or, if it failed, ``"Type: message"``.
    """
    opened: dict[str, Runner] = {}
    failed: dict[str, str] = {}
    windows: dict[str, list[float]] = {name: [] for name in names}
    loads: dict[str, list[float]] = {name: [] for name in names}
    where = f"{workload.label} x {workload.num_envs}"

    def fail(name: str, exc: BaseException) -> None:
        failed[name] = f"{type(exc).__name__}: {exc}"
        if on_error is not None:
            on_error(name, exc)

    try:
        for name in names:
            if progress is not None:
                progress(f"{where}: starting {name}")
            try:
                opened[name] = RUNNERS[name].open(workload, timing)
            except Exception as exc:
                fail(name, exc)
        for repeat in range(timing.repeats):
            for name, runner in list(opened.items()):
                if progress is not None:
                    progress(f"{where}: {name}, window {repeat + 1}/{timing.repeats}")
                try:
                    with OtherLoad() as load:
                        windows[name].append(runner.window(timing.seconds))
                    loads[name].append(load.cores)
                except Exception as exc:
                    fail(name, exc)
                    opened.pop(name).close()
    finally:
        for runner in opened.values():
            with contextlib.suppress(Exception):
                runner.close()
    results: dict[str, RunResult | str] = {}
    for name in names:
        if name in failed:
            results[name] = failed[name]
        else:
            runner = opened[name]
            results[name] = RunResult(name, windows[name], runner.setup_s, runner.info, loads[name])
    return results


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


PACKAGES = (
    "envfleet",
    "gymnasium",
    "numpy",
    "cloudpickle",
    "ale-py",
    "stable-baselines3",
    "envpool",
    "pufferlib",
)


def machine_info(packages: Sequence[str] = ()) -> dict[str, Any]:
    """Cores, CPU, Python, package versions (:data:`PACKAGES` and ``packages``), load and date:
    what the numbers depend on."""
    try:
        load: list[float] | None = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "usable_cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in dict.fromkeys((*PACKAGES, *packages))},
        "load_average_at_start": load,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Report:
    """What :func:`sweep` measured.

    Attributes:
        env: the env's name.
        num_envs: the env counts swept, in order.
        runners: every runner asked for, in order (measured or not).
        timing: how it was measured.
        availability: per runner asked for, whether it could run.
        results: per measured runner, per env count, its result or the error message.
        machine: :func:`machine_info`.
        seconds: wall-clock time of the sweep.
        interrupted: the sweep was stopped (Ctrl-C) before it finished.
    """

    env: str
    num_envs: list[int]
    runners: list[str]
    timing: Timing
    availability: dict[str, Availability]
    results: dict[str, dict[int, RunResult | str]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def measured(self) -> list[str]:
        """The runners that were run (available ones), in order."""
        return [name for name in self.runners if self.availability[name].ok]

    def rate(self, name: str, num_envs: int) -> float | None:
        """Median env-steps/s of ``name`` at ``num_envs``, if it was measured."""
        result = self.results.get(name, {}).get(num_envs)
        return result.median if isinstance(result, RunResult) else None

    def ratio(self, name: str, num_envs: int, reference: str = CEILING) -> float | None:
        value, base = self.rate(name, num_envs), self.rate(reference, num_envs)
        if value is None or not base:
            return None
        return value / base

    def errors(self) -> dict[str, dict[int, str]]:
        """Per runner that failed somewhere, its error message per env count."""
        out: dict[str, dict[int, str]] = {}
        for name, points in self.results.items():
            for n, result in points.items():
                if isinstance(result, str):
                    out.setdefault(name, {})[n] = result
        return out

    def status(self, name: str) -> str:
        if not self.availability[name].ok:
            return self.availability[name].status
        failed = [isinstance(r, str) for r in self.results.get(name, {}).values()]
        if failed and all(failed):
            return FAILED
        return PARTIAL if any(failed) else OK

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for JSON."""
        runners: dict[str, Any] = {}
        for name in self.runners:
            entry: dict[str, Any] = {
                "status": self.status(name),
                "description": RUNNERS[name].description,
            }
            if not self.availability[name].ok:
                entry["reason"] = self.availability[name].reason
                runners[name] = entry
                continue
            points = []
            for n, result in self.results.get(name, {}).items():
                if isinstance(result, str):
                    points.append({"num_envs": n, "error": result})
                    continue
                points.append(
                    {
                        "num_envs": n,
                        "steps_per_s": result.median,
                        "ratio_to_ceiling": self.ratio(name, n, CEILING),
                        "ratio_to_loop": self.ratio(name, n, LOOP),
                        "windows": result.throughputs,
                        "setup_s": result.setup_s,
                        "other_load_cores": result.other_load,
                        **({"info": result.info} if result.info else {}),
                    }
                )
            entry["results"] = points
            runners[name] = entry
        return {
            "env": self.env,
            "num_envs": self.num_envs,
            "runners": runners,
            "not_installed": [
                n for n in self.runners if self.availability[n].status == NOT_INSTALLED
            ],
            "timing": self.timing.as_dict(),
            "machine": self.machine,
            "seconds": self.seconds,
            "interrupted": self.interrupted,
        }


def sweep(
    env: Any,
    num_envs: Sequence[int],
    names: Sequence[str],
    timing: Timing,
    *,
    on_error: Callable[[str, int, BaseException], object] | None = None,
    progress: Callable[[str], object] | None = None,
) -> Report:
    """Measure the available runners of ``names`` at each env count of ``num_envs``.

    Runners that are not installed, or cannot run the env, are skipped (see
    :attr:`Report.availability`). A Ctrl-C stops the sweep and returns what was measured, with
    :attr:`Report.interrupted` set.

    Args:
        env: an id, env class, factory or :class:`EnvSpec`, as :func:`envfleet.make` takes.
        num_envs: env counts, measured in this order.
        names: keys of :data:`RUNNERS`.
        timing: window length, warm-up and repeats.
        on_error: called with the runner name, env count and exception when a runner fails.
        progress: called with a short description of what starts next.
    """
    spec = env if isinstance(env, EnvSpec) else EnvSpec.from_user(env)
    report = Report(
        env=spec.name,
        num_envs=list(num_envs),
        runners=list(names),
        timing=timing,
        availability={name: availability(name, spec) for name in names},
        machine=machine_info(),
    )
    start = time.perf_counter()
    try:
        for n in num_envs:

            def failed(name: str, exc: BaseException, n: int = n) -> None:
                if on_error is not None:
                    on_error(name, n, exc)

            results = measure(
                report.measured, Workload(spec, n), timing, on_error=failed, progress=progress
            )
            for name, result in results.items():
                report.results.setdefault(name, {})[n] = result
    except KeyboardInterrupt:
        report.interrupted = True
    report.seconds = time.perf_counter() - start
    return report


# -- output ----------------------------------------------------------------------------------


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report_table(report: Report) -> Table:
    """One row per measured runner; per env count, steps/s and the ratio to the ceiling."""
    timing = report.timing
    title = f"{report.env}: env-steps/s, median of {timing.repeats} x {timing.seconds:g} s"
    if report.interrupted:
        title += " (interrupted)"
    table = Table(title=title, title_justify="left", min_width=len(title) + 2)
    table.add_column("runner", no_wrap=True)
    with_ceiling = CEILING in report.measured
    for n in report.num_envs:
        table.add_column(f"{n} envs", justify="right")
        if with_ceiling:
            table.add_column("/ceiling", justify="right")
    for name in report.measured:
        cells = [name]
        for n in report.num_envs:
            result = report.results.get(name, {}).get(n)
            if isinstance(result, str):
                cells.append("[red]failed[/red]")
            else:
                cells.append(_fmt_rate(report.rate(name, n)))
            if with_ceiling:
                cells.append(_fmt_ratio(report.ratio(name, n)))
        table.add_row(*cells)
    return table


def report_notes(report: Report) -> list[str]:
    """What to keep in mind reading the table: load from elsewhere, peers' own env ids."""
    notes = []
    loads = [
        c
        for points in report.results.values()
        for r in points.values()
        if isinstance(r, RunResult)
        for c in r.other_load
    ]
    if loads and max(loads) > 0.1:
        notes.append(
            f"other processes kept up to {max(loads):.2f} cores busy during the windows: "
            "these numbers are skewed"
        )
    if "envpool" in report.measured:
        notes.append("envpool steps its own implementation of the env, not Gymnasium's")
    return notes


def write_plot(report: Report, path: Path) -> None:
    """Throughput against ``num_envs``, one line per runner, as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for name in report.measured:
        points = [(n, rate) for n in report.num_envs if (rate := report.rate(name, n)) is not None]
        if not points:
            continue
        xs, ys = [n for n, _ in points], [rate for _, rate in points]
        style: dict[str, Any] = {"linestyle": "--", "color": "black"} if name == CEILING else {}
        ax.plot(xs, ys, marker="o", label=name, **style)
    if len(report.num_envs) > 1 and min(report.num_envs) > 0:
        spread = max(report.num_envs) / min(report.num_envs)
        if spread >= 8:
            ax.set_xscale("log", base=2)
    ax.set_xticks(report.num_envs, [str(n) for n in report.num_envs])
    ax.set_xlabel("num_envs")
    ax.set_ylabel("env-steps per second")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")
    cores = report.machine.get("usable_cores")
    ax.set_title(
        f"{report.env}: throughput vs num_envs"
        + (f" ({cores} cores, median of {report.timing.repeats})" if cores else "")
    )
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside right upper", fontsize="small")
    fig.savefig(path, dpi=100)


def write_json(report: Report, path: Path, **extra: Any) -> dict[str, Any]:
    """Write :meth:`Report.as_dict` (plus ``extra``) to ``path``; return what was written."""
    document = {**report.as_dict(), **extra}
    path.write_text(json.dumps(document, indent=2, default=_jsonable) + "\n")
    return document


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
