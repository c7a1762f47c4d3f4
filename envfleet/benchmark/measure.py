"""Measuring: runners opened on one workload and timed in interleaved windows (:func:`measure`),
the machine the numbers depend on (:func:`machine_info`), and a sweep over env counts
(:func:`sweep`)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import psutil

from envfleet._clock import clock
from envfleet.affinity import usable_cpus
from envfleet.benchmark import base
from envfleet.benchmark.peers import version
from envfleet.benchmark.registry import Availability, availability, opener
from envfleet.benchmark.report import Report
from envfleet.benchmark.wakeups import wake_round_trips
from envfleet.spec import EnvSpec

KILL_GRACE = 10.0
"""Seconds a runner stopped for its start-up has to give up once its processes are killed."""


Opener = Callable[[base.Workload, base.Timing], base.Runner]
Hook = Callable[[str], object] | None


def _quiet(_text: str) -> None:
    """A hook left unset."""


def open_bounded(
    name: str, opener: Opener, workload: base.Workload, timing: base.Timing
) -> base.Runner:
    """``opener(workload, timing)``, stopped after :attr:`Timing.startup_limit` seconds.

    The runner opens in a thread. When the limit passes first, the processes started since
    (its workers) are killed, which makes a start-up waiting on them fail at once; a runner
    that opens anyway is closed. Either way :class:`StartupTimeout` is raised.
    """
    limit = timing.startup_limit
    if limit is None:
        return opener(workload, timing)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["runner"] = opener(workload, timing)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"envfleet-bench-open-{name}", daemon=True)
    thread.start()
    thread.join(limit)
    if not thread.is_alive():
        if "error" in outcome:
            raise outcome["error"]
        return cast(base.Runner, outcome["runner"])
    give_up = time.monotonic() + KILL_GRACE
    while thread.is_alive() and time.monotonic() < give_up:
        for process in psutil.Process().children(recursive=True):
            if process.pid in before:
                continue
            with contextlib.suppress(psutil.Error):
                process.kill()
        thread.join(0.2)
    if "runner" in outcome:
        with contextlib.suppress(Exception):
            outcome["runner"].close()
    raise base.StartupTimeout(f"start-up over {limit:g} s")


def measure(
    names: Sequence[str],
    workload: base.Workload,
    timing: base.Timing,
    *,
    on_error: Callable[[str, BaseException], object] | None = None,
    progress: Hook = None,
    openers: Mapping[str, Opener] | None = None,
    on_stage: Hook = None,
) -> dict[str, base.RunResult | str | base.Skipped]:
    """Open the runners ``names`` on ``workload`` and time their windows, interleaved.

    Args:
        names: keys of :data:`RUNNERS` or their variants (available ones: see
            :func:`availability`).
        on_error: called with the runner name and the exception when a runner fails; the
            runner is then dropped and its entry in the result is the error message.
        progress: called with a short description of what starts next (each opening and
            each window).
        openers: runners of a script's own (a layout, a variant), by name, besides
            :data:`RUNNERS`; a name here wins. A :class:`CallRunner` that does not time its
            own start-up is given the time its opener took, less the warm-up.
        on_stage: called as each runner starts opening (one line per stage, for logs).

    Returns:
        For each name, its :class:`RunResult`; if it failed, ``"Type: message"``; if it took
        longer than :attr:`Timing.startup_limit` to open, :class:`Skipped`.
    """
    progress, on_stage = progress or _quiet, on_stage or _quiet
    opened: dict[str, base.Runner] = {}
    failed: dict[str, str | base.Skipped] = {}
    windows: dict[str, list[float]] = {name: [] for name in names}
    loads: dict[str, list[float]] = {name: [] for name in names}
    where = f"{workload.label} x {workload.num_envs}"

    def fail(name: str, exc: BaseException) -> None:
        failed[name] = f"{type(exc).__name__}: {exc}"
        if on_error is not None:
            on_error(name, exc)

    try:
        for k, name in enumerate(names):
            text = f"{where}: starting {name} ({k + 1} of {len(names)})"
            progress(text)
            on_stage(text)
            try:
                how = openers[name] if openers and name in openers else opener(name)
                start = time.perf_counter()
                opened[name] = runner = open_bounded(name, how, workload, timing)
                if not runner.setup_s:  # not timed by the runner itself
                    runner.setup_s = time.perf_counter() - start - runner.warmup_s
            except base.StartupTimeout as exc:
                failed[name] = base.Skipped(f"{exc}, skipped")
            except Exception as exc:
                fail(name, exc)
        order = list(opened)
        for repeat in range(timing.repeats):
            k = repeat % max(1, len(order))  # each round starts with the next runner
            for name in order[k:] + order[:k]:
                if name not in opened:  # failed in an earlier round
                    continue
                runner = opened[name]
                k = names.index(name) + 1
                progress(
                    f"{where}: {name} ({k} of {len(names)}), window {repeat + 1}/{timing.repeats}"
                )
                try:
                    with base.OtherLoad() as load:
                        windows[name].append(runner.window(timing.seconds))
                    loads[name].append(load.cores)
                    time.sleep(runner.settle_s)
                except Exception as exc:
                    fail(name, exc)
                    opened.pop(name).close()
    finally:
        for runner in opened.values():
            with contextlib.suppress(Exception):
                runner.close()
    return {
        name: failed[name]
        if name in failed
        else base.RunResult(
            name, windows[name], opened[name].setup_s, opened[name].info, loads[name]
        )
        for name in names
    }


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
    """Cores, CPU, Python, package versions (:data:`PACKAGES` and ``packages``), load, what a
    wake-up costs on one core and across two, in µs a round trip
    (:func:`~envfleet.benchmark.wakeups.wake_round_trips`), and date: what the numbers depend
    on."""
    try:
        load: list[float] | None = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "usable_cores": len(usable_cpus()),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in dict.fromkeys((*PACKAGES, *packages))},
        "load_average_at_start": load,
        "wake_round_trip_us": wake_round_trips(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


EXPECTED_MARGIN = 1.5
"""A runner is not started at all when its start-up, scaled from a smaller env count in
proportion to the envs, would exceed the limit by this factor (SB3's ``SubprocVecEnv``, one
process per env: 4.5 s for 8 envs makes about 18 s for 32); nearer the limit, it is tried."""


class _Eta:
    """A sweep's progress: each progress call starts one unit (a runner opening or a window)
    of ``total``; the time left is the time so far scaled to the units left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, -1, time.perf_counter()

    def show(self, hook: Hook, at: str, text: str) -> None:
        """``text`` (``where: what``) to ``hook``, led by the share done and the time left."""
        share = max(0.0, min(1.0, self.done / max(1, self.total)))
        elapsed = time.perf_counter() - self.start
        left = f", ETA {clock(elapsed / share * (1 - share))}" if share > 0 else ""
        where, _, what = text.partition(": ")
        (hook or _quiet)(f"[{share:.0%}{left}] {where}{at}: {what}")

    def count(self, hook: Hook, at: str, text: str) -> None:
        """:meth:`show`, one more unit started."""
        self.done += 1
        self.show(hook, at, text)


def sweep(
    env: Any,
    num_envs: Sequence[int],
    names: Sequence[str],
    timing: base.Timing,
    *,
    on_error: Callable[[str, int, BaseException], object] | None = None,
    progress: Hook = None,
    on_stage: Hook = None,
    openers: Mapping[str, Opener] | None = None,
) -> Report:
    """Measure the available runners of ``names`` at each env count of ``num_envs``.

    Runners that are not installed, or cannot run the env, are skipped (see
    :attr:`Report.availability`). A runner that took longer than
    :attr:`Timing.startup_limit` to start is skipped at the later env counts; one whose
    start-up, scaled in proportion to the envs, would exceed the limit by far
    (:data:`EXPECTED_MARGIN`) is skipped without being started. A Ctrl-C stops the sweep and
    returns what was measured, with :attr:`Report.interrupted` set.

    Args:
        env: an id, env class, factory or :class:`EnvSpec`, as :func:`envfleet.make` takes.
        num_envs: env counts, measured in this order.
        names: keys of :data:`RUNNERS` or of ``openers``.
        on_error: called with the runner name, env count and exception when a runner fails.
        progress: called with a short description of what starts next, led by the share of
            the sweep done and the time left at the pace so far (``[40%, ETA 0:12]``).
        on_stage: the same, once per runner and env count (one line per stage, for logs).
        openers: a script's own runners, as :func:`measure` takes them (always available).
    """
    spec = env if isinstance(env, EnvSpec) else EnvSpec.from_user(env)
    report = Report(
        env=spec.name,
        num_envs=list(num_envs),
        runners=list(names),
        timing=timing,
        availability={
            name: Availability(base.OK) if openers and name in openers else availability(name, spec)
            for name in names
        },
        machine=machine_info(),
    )
    start = time.perf_counter()
    eta = _Eta(len(num_envs) * len(report.measured) * (1 + timing.repeats))
    too_slow: dict[str, base.Skipped] = {}  # start-up grows with num_envs: not tried again
    started: dict[str, tuple[int, float]] = {}  # the latest env count and start-up measured
    try:
        for count, n in enumerate(num_envs):
            limit = timing.startup_limit  # scaled from m envs to n, over it by far: not started
            expected = {
                name: base.Skipped(
                    f"start-up over {limit:g} s expected ({setup_s:.1f} s at {m} envs), skipped"
                )
                for name, (m, setup_s) in started.items()
                if name not in too_slow
                and limit is not None
                and setup_s * n / m > EXPECTED_MARGIN * limit
            }
            names_now = [
                name for name in report.measured if name not in too_slow and name not in expected
            ]
            eta.total -= (len(report.measured) - len(names_now)) * (1 + timing.repeats)
            at = f" ({count + 1} of {len(num_envs)})" if len(num_envs) > 1 else ""

            def failed(name: str, exc: BaseException, n: int = n) -> None:
                if on_error is not None:
                    on_error(name, n, exc)

            results = measure(
                names_now,
                base.Workload(spec, n),
                timing,
                on_error=failed,
                progress=functools.partial(eta.count, progress, at),
                openers=openers,
                on_stage=functools.partial(eta.show, on_stage, at),
            )
            results.update(expected)
            for name in report.measured:
                result = results[name] if name in results else too_slow[name]
                if isinstance(result, base.RunResult):
                    started[name] = (n, result.setup_s)
                report.results.setdefault(name, {})[n] = result
                if isinstance(result, base.Skipped) and name not in too_slow:
                    too_slow[name] = base.Skipped(result.reason.replace(", ", f" at {n} envs, ", 1))
    except KeyboardInterrupt:
        report.interrupted = True
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["KILL_GRACE", "machine_info", "measure", "sweep"]
