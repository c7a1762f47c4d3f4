"""Throughput runners: each builds its envs, resets and warms up, then times stepping windows.

A runner is opened with ``RUNNERS[name](workload, timing)``, which builds and resets its envs and
warms up; each :meth:`Runner.window` then steps for a given number of seconds and returns
env-steps per second (a vector step of ``n`` envs counts ``n``). Actions are random, sampled
before the clock starts and cycled, so sampling does not weigh on the result.

:func:`measure` opens several runners on one workload and interleaves their windows (window 1
of every runner, then window 2, ...), so a burst of load from elsewhere on the machine hits all
runners alike instead of one; the median window is what gets reported.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
import psutil
from gymnasium import spaces
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorEnv

import envfleet
from bench.envs import Workload

CEILING_TIMEOUT = 600.0
"""Seconds the ceiling's processes and their parent wait for each other before giving up."""


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

    seconds: float = 3.0
    warmup: float = 0.5
    rewarm: float = 0.2
    repeats: int = 3
    seed: int = 0
    action_batches: int = 256


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


def usable_cores() -> int:
    """Cores this process may run on (CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


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

    def __enter__(self) -> OtherLoad:
        self.cores = 0.0
        self._start = (time.perf_counter(), _busy_cpu_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall, busy, own = self._start
        wall = time.perf_counter() - wall
        other = (_busy_cpu_s() - busy) - (_own_cpu_s() - own)
        self.cores = max(0.0, other / wall) if wall > 0 else 0.0


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


# -- plain for-loop ------------------------------------------------------------------------------


def _to_python(space: spaces.Space[Any], action: Any) -> Any:
    return int(action) if isinstance(space, spaces.Discrete) else action


def _for_loop(
    workload: Workload, count: int, timing: Timing, first_index: int = 0
) -> tuple[Callable[[Any], object], list[list[Any]], list[gymnasium.Env[Any, Any]]]:
    """Build and reset ``count`` envs; return a sweep over them, its actions and the envs."""
    envs = [workload.build() for _ in range(count)]
    for i, env in enumerate(envs):
        env.reset(seed=timing.seed + first_index + i)
    space = envs[0].action_space
    space.seed(timing.seed + first_index)
    actions = [
        [_to_python(space, space.sample()) for _ in range(count)]
        for _ in range(timing.action_batches)
    ]

    def sweep(batch: list[Any]) -> None:
        for env, action in zip(envs, batch, strict=True):
            _, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                env.reset()

    return sweep, actions, envs


def open_for_loop(workload: Workload, timing: Timing) -> Runner:
    """A Python for-loop over ``gymnasium.make`` envs in this process, resetting finished ones."""
    start = time.perf_counter()
    sweep, actions, envs = _for_loop(workload, workload.num_envs, timing)
    setup_s = time.perf_counter() - start

    def close() -> None:
        for env in envs:
            env.close()

    return LoopRunner("for-loop", sweep, actions, workload.num_envs, timing, setup_s, close)


# -- independent-processes ceiling ---------------------------------------------------------------


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
        self.name = "ceiling"
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


def open_ceiling(workload: Workload, timing: Timing) -> Runner:
    """See :class:`CeilingRunner`."""
    return CeilingRunner(workload, timing)


# -- vector envs ---------------------------------------------------------------------------------


def _open_vector(
    name: str, build: Callable[[], VectorEnv], timing: Timing, **info: Any
) -> LoopRunner:
    start = time.perf_counter()
    vec = build()
    try:
        vec.reset(seed=timing.seed)
        setup_s = time.perf_counter() - start
        vec.action_space.seed(timing.seed)
        actions = [vec.action_space.sample() for _ in range(timing.action_batches)]
    except BaseException:
        vec.close()
        raise
    return LoopRunner(name, vec.step, actions, vec.num_envs, timing, setup_s, vec.close, **info)


def open_sync_vector(workload: Workload, timing: Timing) -> Runner:
    """Gymnasium's ``SyncVectorEnv``."""
    fns = [workload.factory()] * workload.num_envs
    return _open_vector("gym-sync", lambda: SyncVectorEnv(fns), timing)


def open_async_vector(workload: Workload, timing: Timing) -> Runner:
    """Gymnasium's ``AsyncVectorEnv(shared_memory=True)``: one process per env."""
    fns = [workload.factory()] * workload.num_envs
    return _open_vector(
        "gym-async",
        lambda: AsyncVectorEnv(fns, shared_memory=True),
        timing,
        processes=workload.num_envs,
    )


def open_envfleet_serial(workload: Workload, timing: Timing) -> Runner:
    """``envfleet.make(..., backend="serial")``."""
    return _open_vector(
        "envfleet-serial",
        lambda: envfleet.make(workload.env, workload.num_envs, backend="serial"),
        timing,
    )


def open_envfleet_process(workload: Workload, timing: Timing) -> Runner:
    """``envfleet.make(..., backend="process")`` with its default worker count."""
    return _open_vector(
        "envfleet-process",
        lambda: envfleet.make(workload.env, workload.num_envs, backend="process"),
        timing,
        processes=min(usable_cores(), workload.num_envs),
    )


RUNNERS: dict[str, Callable[[Workload, Timing], Runner]] = {
    "for-loop": open_for_loop,
    "ceiling": open_ceiling,
    "gym-sync": open_sync_vector,
    "gym-async": open_async_vector,
    "envfleet-serial": open_envfleet_serial,
    "envfleet-process": open_envfleet_process,
}
"""Every runner by its command-line name, in the order they are run and shown."""


def measure(
    names: Sequence[str],
    workload: Workload,
    timing: Timing,
    *,
    on_error: Callable[[str, BaseException], object] | None = None,
) -> dict[str, RunResult | str]:
    """Open the runners ``names`` on ``workload`` and time their windows, interleaved.

    Args:
        names: keys of :data:`RUNNERS`.
        workload: what to step.
        timing: window length, warm-up and repeats.
        on_error: called with the runner name and the exception when a runner fails; the
            runner is then dropped and its entry in the result is the error message.

    Returns:
        For each name, its :class:`RunResult` or, if it failed, ``"Type: message"``.
    """
    opened: dict[str, Runner] = {}
    failed: dict[str, str] = {}
    windows: dict[str, list[float]] = {name: [] for name in names}
    loads: dict[str, list[float]] = {name: [] for name in names}

    def fail(name: str, exc: BaseException) -> None:
        failed[name] = f"{type(exc).__name__}: {exc}"
        if on_error is not None:
            on_error(name, exc)

    try:
        for name in names:
            try:
                opened[name] = RUNNERS[name](workload, timing)
            except Exception as exc:
                fail(name, exc)
        for _ in range(timing.repeats):
            for name, runner in list(opened.items()):
                try:
                    with OtherLoad() as load:
                        windows[name].append(runner.window(timing.seconds))
                    loads[name].append(load.cores)
                except Exception as exc:
                    fail(name, exc)
                    opened.pop(name).close()
    finally:
        for runner in opened.values():
            runner.close()
    results: dict[str, RunResult | str] = {}
    for name in names:
        if name in failed:
            results[name] = failed[name]
        else:
            runner = opened[name]
            results[name] = RunResult(name, windows[name], runner.setup_s, runner.info, loads[name])
    return results
