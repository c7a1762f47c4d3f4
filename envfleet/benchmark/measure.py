"""Measuring: runners opened on one workload and timed in interleaved windows (:func:`measure`),
the machine the numbers depend on (:func:`machine_info`), and a sweep over env counts
(:func:`sweep`)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from envfleet._make import usable_cores
from envfleet.benchmark.base import OtherLoad, Runner, RunResult, Timing, Workload
from envfleet.benchmark.registry import RUNNERS, availability
from envfleet.benchmark.report import Report
from envfleet.spec import EnvSpec


def measure(
    names: Sequence[str],
    workload: Workload,
    timing: Timing,
    *,
    on_error: Callable[[str, BaseException], object] | None = None,
    progress: Callable[[str], object] | None = None,
    open_runner: Callable[[str, Workload, Timing], Runner] | None = None,
) -> dict[str, RunResult | str]:
    """Open the runners ``names`` on ``workload`` and time their windows, interleaved.

    Args:
        names: keys of :data:`RUNNERS` (available ones: see :func:`availability`).
        workload: what to step.
        timing: window length, warm-up and repeats.
        on_error: called with the runner name and the exception when a runner fails; the
            runner is then dropped and its entry in the result is the error message.
        progress: called with a short description of what starts next.
        open_runner: opens runner ``name`` (default: ``RUNNERS[name].open``); other sets of
            runners, such as :mod:`~envfleet.benchmark.rollout`'s, come in through it.

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
                if open_runner is None:
                    opened[name] = RUNNERS[name].open(workload, timing)
                else:
                    opened[name] = open_runner(name, workload, timing)
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
