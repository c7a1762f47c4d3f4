"""What every runner shares: timing settings, the workload, results, load from elsewhere on the
machine, and the runner interface (:class:`Runner`, :class:`LoopRunner` and vector envs opened
as one)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium
import psutil

from envfleet.spec import EnvSpec

LOOP = "loop"
CEILING = "ceiling"

# Runner statuses in a report.
OK = "ok"
FAILED = "failed"
PARTIAL = "partial"  # failed or skipped at some env counts only
SKIPPED = "skipped"  # too slow to start at every env count
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
        startup_limit: seconds a runner may take to open (build, reset, warm up); one that
            takes longer is stopped (the processes it started are killed) and reported
            :class:`Skipped`, at that env count and the larger ones. ``None``: no limit.
    """

    seconds: float = 1.0
    warmup: float = 0.5
    rewarm: float = 0.2
    repeats: int = 3
    seed: int = 0
    action_batches: int = 256
    startup_limit: float | None = None

    @classmethod
    def scaled(
        cls, seconds: float, repeats: int, seed: int = 0, startup_limit: float | None = None
    ) -> Timing:
        """Windows of ``seconds``, with warm-ups in proportion when windows are short."""
        return cls(
            seconds=seconds,
            warmup=min(0.5, seconds),
            rewarm=min(0.2, seconds / 5),
            repeats=repeats,
            seed=seed,
            startup_limit=startup_limit,
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


@dataclass(frozen=True)
class Skipped:
    """A runner not measured at an env count, and why (its start-up took too long)."""

    reason: str

    def __str__(self) -> str:
        return self.reason


class StartupTimeout(Exception):
    """A runner took longer than :attr:`Timing.startup_limit` to open (the message says
    ``"start-up over N s"``)."""


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


# -- the runner interface --------------------------------------------------------------------


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
    settle_s: float = 0.0
    """Idle seconds after each of its windows (workers that spin on after their last command
    would otherwise eat into the next runner's window: PufferLib's, for one)."""

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


def time_calls(step: Callable[[], int], seconds: float) -> float:
    """Call ``step`` for ``seconds``; the env-steps (its returns, summed) per second."""
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        steps += step()
        now = time.perf_counter()
        if now >= deadline:
            return steps / (now - start)


class CallRunner(Runner):
    """Times ``advance()`` in this process; each call returns the env-steps it delivered.

    For runners whose unit of work is not one vector step of every env: an async
    ``recv`` + ``send`` (a batch of whichever envs were ready), one env timed alone. Warms up for
    ``timing.warmup`` seconds when opened, as :class:`LoopRunner` does.
    """

    def __init__(
        self,
        name: str,
        advance: Callable[[], int],
        close: Callable[[], object],
        timing: Timing,
        *,
        setup_s: float = 0.0,
        settle_s: float = 0.0,
        **info: Any,
    ) -> None:
        self.name, self.setup_s, self.settle_s, self.info = name, setup_s, settle_s, info
        self.advance, self._close, self._rewarm = advance, close, timing.rewarm
        start = time.perf_counter()
        try:
            self._time(timing.warmup)
            time.sleep(settle_s)
        except BaseException:
            close()
            raise
        self.warmup_s = time.perf_counter() - start

    def _time(self, seconds: float) -> float:
        return time_calls(self.advance, seconds)

    def window(self, seconds: float) -> float:
        self._time(self._rewarm)
        return self._time(seconds)

    def close(self) -> None:
        self._close()


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
