"""Threads and the GIL: the bare-threads ceiling, the main-thread progress probe, 1 vs 2 threads
vs 2 processes, and whether a free-threaded CPython is at hand.

- :func:`open_bare_threads`: the least any Python thread pool can do (one thread per env, woken
  by one eventfd write), the ceiling of threads with a GIL on this machine.
- :func:`gil_probe`: does a C call release the GIL? A pure-Python loop in this thread runs while
  another thread repeats the call (:func:`main_thread_progress`); its speed, as a fraction of
  its speed beside ``time.sleep`` (which releases), is the answer, whatever the machine's load.
- :func:`scaling_cases` and :func:`scaling_verdict`: one thread, two threads and two processes,
  each stepping its own env, through :class:`~envfleet.benchmark.ParallelRunner`.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from envfleet.benchmark.base import CallRunner, Runner, Timing, Workload
from envfleet.benchmark.cases import Case, fmt, ratio
from envfleet.benchmark.runners import ParallelRunner

Stepper = Callable[[int], Callable[[], int]]
"""Builds, in worker ``i``, a step that returns the env-steps it made (for ParallelRunner)."""


def open_bare_threads(workload: Workload, timing: Timing, cpus: list[int] | None = None) -> Runner:
    """The least any Python thread pool can do: one thread per env, every step started by one
    write to a shared eventfd (semaphore mode: each thread takes one), the end signalled by the
    last thread through a lock; no actions, no results, no error handling. ``cpus``: pin the
    env threads there (the caller's thread stays free). What this reaches is the ceiling of
    threads with a GIL on this machine. A step is ``num_envs`` env steps, but not always one
    per env: a thread that finishes early may take a second token and step its env again."""
    num_envs = workload.num_envs
    envs = [workload.spec.build() for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=timing.seed + i)
    bell = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC)
    done = threading.Lock()
    done.acquire()
    count_lock = threading.Lock()
    left = [0]
    stop = threading.Event()

    def serve(env: Any) -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        while True:
            os.eventfd_read(bell)
            if stop.is_set():
                return
            env.step(0)
            with count_lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done.release()

    threads = [threading.Thread(target=serve, args=(env,), daemon=True) for env in envs]
    for thread in threads:
        thread.start()

    def advance() -> int:
        left[0] = num_envs
        os.eventfd_write(bell, num_envs)
        done.acquire()
        return num_envs

    def close() -> None:
        stop.set()
        os.eventfd_write(bell, num_envs)
        for thread in threads:
            thread.join(1.0)
        os.close(bell)
        for env in envs:
            env.close()

    return CallRunner("bare threads", advance, close, timing, threads=num_envs, cpus=cpus)


def main_thread_progress(call: Callable[[], object], seconds: float) -> float:
    """Iterations/s of a pure-Python loop in this thread while another thread repeats ``call``.

    A call that releases the GIL leaves this loop its full speed; one that holds it stalls the
    loop for as long as it runs (C code is never interrupted to hand the GIL over). Machine load
    slows both alike, so the ratio to the ``time.sleep`` reference measures the GIL, not the
    free cores.
    """
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            call()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    time.sleep(0.01)
    try:
        loops = 0
        start = now = time.perf_counter()
        deadline = start + seconds
        while now < deadline:
            loops += 1
            now = time.perf_counter()
    finally:
        stop.set()
        worker.join()
    return loops / (now - start)


RELEASES = "time.sleep(0.05) (releases)"
HOLDS = "sum(range(3e6)) (holds)"
REFERENCES: dict[str, Callable[[], Callable[[], object]]] = {
    RELEASES: lambda: functools.partial(time.sleep, 0.05),
    HOLDS: lambda: functools.partial(sum, range(3_000_000)),
}
"""Two C calls whose GIL behaviour is known, probed beside the calls in question."""


def gil_probe(
    calls: Mapping[str, Callable[[], Callable[[], object]]], timing: Timing, console: Console
) -> dict[str, dict[str, Any]]:
    """Probe :data:`REFERENCES` and ``calls`` (name: a builder of the call) in rotating order
    (``timing.repeats`` rounds of windows of at least 1 s); print a table, return each one's
    main-thread loops/s, its ratio to the sleep reference (about 1: releases the GIL; about 0:
    holds it) and its windows."""
    built = {name: make() for name, make in {**REFERENCES, **calls}.items()}
    names = list(built)
    rates: dict[str, list[float]] = {name: [] for name in names}
    seconds, rounds = max(1.0, timing.seconds), max(1, timing.repeats)
    with console.status("GIL probe ..."):
        for round_ in range(rounds):
            k = round_ % len(names)
            for name in names[k:] + names[:k]:
                rates[name].append(main_thread_progress(built[name], seconds))
    free = statistics.median(rates[RELEASES])
    table = Table(
        title=f"GIL probe: main-thread loop while another thread repeats a call "
        f"({rounds} x {seconds:g} s, median)",
        title_justify="left",
    )
    for column in ("call in the other thread", "main loops/s", "vs sleep", "windows"):
        table.add_column(column, justify="left" if column.startswith("call") else "right")
    out: dict[str, dict[str, Any]] = {}
    for name, values in rates.items():
        progress = statistics.median(values)
        windows = " ".join(f"{v:,.0f}" for v in values)
        table.add_row(name, f"{progress:,.0f}", fmt(ratio(progress, free)), windows)
        out[name] = {
            "main_loops_per_s": progress,
            "ratio_to_sleep": ratio(progress, free),
            "windows": values,
        }
    console.print(table)
    return out


def open_parallel(
    workload: Workload, timing: Timing, *, make_step: Stepper, count: int, mode: str
) -> Runner:
    """``count`` threads (``mode="thread"``) or processes, each stepping its own env; rates
    summed."""
    threads = mode == "thread"
    return ParallelRunner(f"{count} {mode}", make_step, count, timing, threads=threads, mode=mode)


def scaling_cases(label: str, make_step: Stepper) -> list[Case]:
    """``label: 1 thread``, ``label: 2 threads`` and ``label: 2 processes``, each worker
    stepping its own ``make_step(i)``."""
    return [
        Case(
            f"{label}: {name}",
            functools.partial(open_parallel, make_step=make_step, count=count, mode=mode),
            forks=mode == "process",
        )
        for name, count, mode in (
            ("1 thread", 1, "thread"),
            ("2 threads", 2, "thread"),
            ("2 processes", 2, "process"),
        )
    ]


def scaling_verdict(thread_speedup: float | None, process_speedup: float | None) -> str:
    """Reading the 2-thread and 2-process speedups over 1 thread (meaningful on a quiet machine)."""
    if thread_speedup is None or process_speedup is None:
        return "not measured"
    summary = f"2 threads {thread_speedup:.2f}x, 2 processes {process_speedup:.2f}x"
    if process_speedup < 1.3:
        return f"scaling inconclusive (2 processes do not scale: machine busy): {summary}"
    if thread_speedup >= max(1.3, 0.75 * process_speedup):
        return f"threads scale like processes: {summary}"
    if thread_speedup < 1.15:
        return f"threads do not scale: {summary}"
    return f"threads scale partly: {summary}"


def free_threaded_probe() -> dict[str, Any]:
    """Is a free-threaded CPython (3.13t/3.14t) at hand? Looks only; installs nothing."""
    found: dict[str, Any] = {
        "this_interpreter_gil_disabled": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "on_path": {
            name: shutil.which(name)
            for name in ("python3.13t", "python3.14t", "python3t", "python3.13", "python3.14")
        },
    }
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            listing = subprocess.run(
                [pyenv, "versions", "--bare"], capture_output=True, text=True, timeout=20
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            listing = []
        found["pyenv_versions"] = listing
        found["pyenv_free_threaded"] = [v for v in listing if v.endswith("t")]
    return found
