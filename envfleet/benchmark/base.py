"""What every runner shares: timing settings, the workload, results, load from elsewhere on the
machine, and the runner interface (:class:`Runner`, :class:`CallRunner` and vector envs opened
as one, synchronously or EnvPool-style by batch)."""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium
import numpy as np
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
        warmup, rewarm = min(0.5, seconds), min(0.2, seconds / 5)
        return cls(seconds, warmup, rewarm, repeats, seed, startup_limit=startup_limit)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "interleaved": True,
            "statistic": "median",
            "ratios": "median of per-round ratios",
            "unit": "env-steps per second",
        }


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
        return self.spec.build


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

    def over(self, reference: RunResult) -> float:
        """This runner's throughput over ``reference``'s, measured in the same run: the median
        of the per-round ratios (window ``k`` of each: :func:`measure` times every runner once
        per round, so a round's windows are seconds apart) when both have every round, else
        the ratio of their medians.

        A shared machine's speed drifts by tens of percent within minutes: a drift between
        rounds moves both windows of a round alike and leaves their ratio, where the ratio of
        medians can take one runner's median from a fast round and the other's from a slow one.
        """
        mine, theirs = self.throughputs, reference.throughputs
        if len(mine) != len(theirs) or not all(theirs):
            return self.median / reference.median
        return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


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


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (``guest`` is already inside ``user``)."""
    t = psutil.cpu_times()
    return float(sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq")))


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    """CPU seconds of ``processes``, every thread: from the scheduler's nanosecond count
    (``/proc/PID/task/*/schedstat``) where there is one, else ``psutil`` (10 ms ticks)."""
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error, OSError):  # ended: its last figures are lost
            try:
                tasks = os.listdir(f"/proc/{process.pid}/task")
            except OSError:
                times = process.cpu_times()
                total += times.user + times.system
                continue
            for task in tasks:
                with (
                    contextlib.suppress(OSError),
                    open(f"/proc/{process.pid}/task/{task}/schedstat") as f,
                ):
                    total += int(f.read().split()[0]) * 1e-9
    return total


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its live descendants."""
    me = psutil.Process()
    return cpu_seconds([me, *me.children(recursive=True)])


class OtherLoad:
    """Measures the cores used by processes outside this process tree over a stretch of time."""

    cores: float = 0.0

    def __enter__(self) -> OtherLoad:
        self.cores = 0.0
        self._start = (time.perf_counter(), busy_cpu_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall, busy, own = self._start
        wall = time.perf_counter() - wall
        other = (busy_cpu_s() - busy) - (_own_cpu_s() - own)
        self.cores = max(0.0, other / wall) if wall > 0 else 0.0


def join_all(processes: Sequence[Any], timeout: float = 10.0) -> None:
    """Wait ``timeout`` seconds for each of ``processes`` (told to stop) to end; terminate it
    if it has not."""
    for process in processes:
        process.join(timeout=timeout)
        if process.is_alive():
            process.terminate()
            process.join()


# -- the runner interface --------------------------------------------------------------------


class Runner:
    """An open runner: its envs are built, reset and warmed up.

    Attributes:
        name: runner name.
        setup_s: seconds it took to build and reset the envs (left 0, :func:`measure` times
            its opener, less ``warmup_s``).
        info: runner-specific details for the results.
    """

    name: str
    info: dict[str, Any]
    setup_s: float = 0.0
    warmup_s: float = 0.0
    settle_s: float = 0.0
    """Idle seconds after each of its windows (workers that spin on after their last command
    would otherwise eat into the next runner's window: PufferLib's, for one)."""

    def window(self, seconds: float) -> float:
        """Step for ``seconds`` (after ``timing.rewarm`` untimed); env-steps per second."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def time_calls(step: Callable[[], int], seconds: float) -> float:
    """Call ``step`` for ``seconds``; the env-steps (its returns, summed) per second."""
    steps, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        steps += step()
        now = time.perf_counter()
        if now >= deadline:
            return steps / (now - start)


def cycle(step: Callable[[Any], object], actions: Sequence[Any], envs_per_call: int) -> Any:
    """An ``advance`` for :class:`CallRunner` that calls ``step`` with the actions in turn."""
    following = itertools.cycle(actions).__next__

    def advance() -> int:
        step(following())
        return envs_per_call

    return advance


class CallRunner(Runner):
    """Times ``advance()`` in this process; each call returns the env-steps it delivered (a
    vector step of every env, an async ``recv`` + ``send`` of a batch, one env timed alone).
    Warms up for ``timing.warmup`` seconds when opened; closes on a failure meanwhile."""

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
            time_calls(advance, timing.warmup)
            time.sleep(settle_s)
        except BaseException:
            close()
            raise
        self.warmup_s = time.perf_counter() - start

    def window(self, seconds: float) -> float:
        time_calls(self.advance, self._rewarm)
        return time_calls(self.advance, seconds)

    def close(self) -> None:
        self._close()


def sample_actions(space: gymnasium.Space[Any], batch: int | None, timing: Timing) -> list[Any]:
    """``timing.action_batches`` samples of ``space`` (one env's), each ``batch`` of them
    stacked (``None``: not stacked)."""
    space.seed(timing.seed)
    if batch is None:
        return [space.sample() for _ in range(timing.action_batches)]
    return [
        np.stack([np.asarray(space.sample()) for _ in range(batch)])
        for _ in range(timing.action_batches)
    ]


def open_vector(
    name: str,
    build: Callable[[], Any],
    timing: Timing,
    *,
    batch: int | None = None,
    reset: Callable[[Any], Any] | None = None,
    policy: Callable[[Any], Any] | None = None,
    settle_s: float = 0.0,
    **info: Any,
) -> Runner:
    """A runner over the vector env ``build()`` makes, closed on any failure.

    Synchronous (``batch`` ``None`` or every env): reset (``vec.reset(seed=...)``, or
    ``reset(vec)``, which returns the observations), then ``vec.step`` with stacked samples of
    its ``single_action_space`` (or its ``action_space`` when it has none: SB3, EnvPool). By
    batch (EnvPool's API, which envfleet's pool shares): ``async_reset``, then ``recv`` a batch
    and ``send`` actions to the envs in it (``infos["env_id"]``). With a ``policy`` (a batch of
    observations to a batch of actions), its actions instead of samples: training's loop.
    """
    vec = build()
    try:
        n = vec.num_envs
        space = getattr(vec, "single_action_space", None) or vec.action_space
        actions = sample_actions(space, batch or n, timing)
        if batch is None or batch == n:
            first = (reset or (lambda v: v.reset(seed=timing.seed)))(vec)
            obs = [first[0] if isinstance(first, tuple) else first]

            def step(acts: Any) -> None:
                obs[0] = vec.step(acts if policy is None else policy(obs[0]))[0]

            advance = cycle(step, actions, n)
        else:
            (reset or (lambda v: v.async_reset(seed=timing.seed)))(vec)

            def recv_send(acts: Any) -> None:
                obs, *_, infos = vec.recv()
                vec.send(acts if policy is None else policy(obs), infos["env_id"])

            advance = cycle(recv_send, actions, batch)
    except BaseException:
        vec.close()
        raise
    return CallRunner(name, advance, vec.close, timing, settle_s=settle_s, **info)


__all__ = [
    "FAILED",
    "OK",
    "CallRunner",
    "RunResult",
    "Runner",
    "Skipped",
    "Timing",
    "Workload",
    "busy_cpu_s",
    "cycle",
    "open_vector",
    "sample_actions",
]
