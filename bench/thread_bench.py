"""Thread backend: sleeping envs and ALE's Pong against the for-loop and the alternatives.

Three parts, each side by side in one run (windows interleaved, order rotating each round, the
median window reported):

- ``sleep``: :class:`bench.envs.SleepEnv` (``time.sleep(0.001)`` per step) x 32. The ideal is
  ``32 / measured step time`` (``ideal`` row: one env stepped alone, counted 32 times; the sleep
  takes longer than 1 ms). Rows: for-loop, bare threads (no library: one thread per env started
  by one eventfd write, the ceiling of a Python thread pool with a GIL here; unpinned and pinned
  to one core), envfleet thread (one thread per env; and with every
  env thread pinned to one core, ``cpu_affinity=[last usable CPU]``), envfleet process (2
  workers; and 2 workers x 16 threads, unpinned and ``cpu_affinity="spread"``: one core per
  worker), Gymnasium ``AsyncVectorEnv`` (32 processes). Target: envfleet thread at least 0.8 of
  the ideal.
- ``gil``: does ale-py release the GIL while it emulates? Pong stepped by 1 thread, by 2 threads
  (each its own env) and by 2 processes (what the machine allows without a GIL); the same for
  ``ALEInterface.act`` called directly. If 2 threads scale like 2 processes, it does.
- ``pong``: ``ALE/Pong-v5`` x 8: for-loop, envfleet thread (8 threads), envfleet process (2
  workers, unpinned and ``cpu_affinity="spread"``; and 2 workers x 4 threads), Gymnasium
  ``AsyncVectorEnv`` (8 processes) and ale-py's own C++ ``AtariVectorEnv`` (configured like
  ``ALE/Pong-v5``: 210x160 RGB, no frame stack, sticky actions 0.25; and with its default
  84x84 grey x4 preprocessing). Target: envfleet thread at least 1.6x the for-loop.

It also records whether a free-threaded CPython (3.13t/3.14t) is at hand here.

Usage::

    python bench/thread_bench.py                 # everything: 3 x 3 s windows, about 4.5 minutes
    python bench/thread_bench.py --quick         # smoke run: 1 x 0.5 s window, under 1 minute
    python bench/thread_bench.py --parts pong,gil --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functools
import os
import shutil
import statistics
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import (
    RESULTS,
    Case,
    IdealRunner,
    Versus,
    add_choice,
    fmt,
    measure_cases,
    measure_table,
    median_of,
    print_machine,
    progress,
    ratio,
    results_table,
    save_json,
    script_parser,
    session,
    target,
    timing_from,
    versus,
)
from bench.envs import SleepEnv
from envfleet import benchmark
from envfleet.benchmark import CallRunner, Runner, Timing, Workload, open_envfleet, version

SLEEP_TARGET = 0.8
PONG_TARGET = 1.6
# -- threads and the GIL ------------------------------------------------------------------------


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
        loops = statistics.median(values)
        windows = " ".join(f"{v:,.0f}" for v in values)
        table.add_row(name, f"{loops:,.0f}", fmt(ratio(loops, free)), windows)
        out[name] = {
            "main_loops_per_s": loops,
            "ratio_to_sleep": ratio(loops, free),
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
    return benchmark.ParallelRunner(
        f"{count} {mode}", make_step, count, timing, threads=threads, mode=mode
    )


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
    names = ("python3.13t", "python3.14t", "python3t")
    return {
        "this_interpreter_gil_disabled": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "on_path": {name: shutil.which(name) for name in names},
    }


# -- workloads and runners of this script ------------------------------------------------------


ATARI_PREPROCESSED = {"stack_num": 4, "img_height": 84, "img_width": 84, "grayscale": True,
                      "maxpool": True, "noop_max": 30, "reward_clipping": True,
                      "use_fire_reset": True}  # fmt: skip
"""``AtariVectorEnv``'s own defaults (84x84 grey, 4 frames stacked), over the id's frame skip."""


def pong_stepper(index: int) -> Callable[[], int]:
    """Steps one ``ALE/Pong-v5`` env through Gymnasium (random actions, resets when done)."""
    env = Workload.of("ALE/Pong-v5", 1).spec.build()
    env.reset(seed=index)
    actions = np.random.default_rng(index).integers(0, int(env.action_space.n), size=(256, 1))
    state = [0]

    def step() -> int:
        k = state[0]
        _, _, terminated, truncated, _ = env.step(int(actions[k % 256][0]))
        state[0] = k + 1
        if terminated or truncated:
            env.reset()
        return 1

    return step


def _ale(seed: int, frame_skip: int = 1) -> Any:
    """A bare ``ALEInterface`` on Pong (``frame_skip`` emulator frames per ``act``)."""
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.setInt("random_seed", seed)
    ale.setInt("frame_skip", frame_skip)
    ale.loadROM(roms.get_rom_path("pong"))
    return ale


def ale_act_stepper(index: int) -> Callable[[], int]:
    """Calls ``ALEInterface.act`` directly (one emulator frame per call; resets at game over)."""
    ale = _ale(index)
    moves = ale.getMinimalActionSet()
    actions = [moves[i] for i in np.random.default_rng(index).integers(0, len(moves), size=256)]
    state = [0]

    def step() -> int:
        ale.act(actions[state[0] % 256])
        state[0] += 1
        if ale.game_over():
            ale.reset_game()
        return 1

    return step


LONG_ACT_FRAMES = 2000
"""Emulator frames per ``ale.act`` call in the progress probe (ALE's ``frame_skip``)."""


def long_act_call() -> Callable[[], None]:
    """One ``ALEInterface.act`` call that emulates ``LONG_ACT_FRAMES`` frames (~0.1-0.3 s)."""
    ale = _ale(0, LONG_ACT_FRAMES)
    noop = ale.getMinimalActionSet()[0]

    def call() -> None:
        ale.act(noop)
        if ale.game_over():
            ale.reset_game()

    return call


PROBES: dict[str, Callable[[], Callable[[], object]]] = {
    f"ale.act, {LONG_ACT_FRAMES} frames a call": long_act_call,
    "Pong env.step": lambda: pong_stepper(0),
}

# -- parts ---------------------------------------------------------------------------------------


IDEAL = "ideal (32 x 1 env)"
LOOP = "for-loop"
THREAD_PINNED = "envfleet thread, pinned to 1 core"
BARE_PINNED = "bare threads, pinned to 1 core"


def one_core() -> list[int]:
    """The core the pinned thread rows pack their env threads on: the last usable one."""
    return [max(os.sched_getaffinity(0))]


TWO_WORKERS: dict[str, Any] = {"backend": "process", "num_workers": 2}


def sleep_cases() -> list[Case]:
    ef = functools.partial
    return [
        Case(IDEAL, IdealRunner),
        Case(LOOP, benchmark.open_loop),
        Case("bare threads", open_bare_threads),
        Case(BARE_PINNED, lambda w, t: open_bare_threads(w, t, cpus=one_core())),
        Case("envfleet thread", ef(open_envfleet, backend="thread")),
        Case(THREAD_PINNED, ef(open_envfleet, backend="thread", cpu_affinity=one_core())),
        Case("envfleet process 2w", ef(open_envfleet, **TWO_WORKERS), forks=True),
        Case(
            "envfleet process 2w x16t",
            ef(open_envfleet, backend="process", num_workers=2, threads_per_worker=16),
            forks=True,
        ),
        Case(
            "envfleet process 2w x16t, spread",
            ef(open_envfleet, backend="process", num_workers=2, threads_per_worker=16,
               cpu_affinity="spread"),
            forks=True,
        ),
        Case("gym AsyncVectorEnv", benchmark.open_gym_async, forks=True),
    ]  # fmt: skip


def pong_cases() -> list[Case]:
    ef = functools.partial
    return [
        Case(LOOP, benchmark.open_loop),
        Case("envfleet thread", ef(open_envfleet, backend="thread")),
        Case("envfleet process 2w", ef(open_envfleet, **TWO_WORKERS), forks=True),
        Case(
            "envfleet process 2w, spread",
            ef(open_envfleet, backend="process", num_workers=2, cpu_affinity="spread"),
            forks=True,
        ),
        Case(
            "envfleet process 2w x4t",
            ef(open_envfleet, backend="process", num_workers=2, threads_per_worker=4),
            forks=True,
        ),
        Case("gym AsyncVectorEnv", benchmark.open_gym_async, forks=True),
        Case("ale AtariVectorEnv (as ALE/Pong-v5)", benchmark.open_ale_vector),
        Case("ale AtariVectorEnv (84x84 grey x4)",
             ef(benchmark.open_ale_vector, **ATARI_PREPROCESSED)),
    ]  # fmt: skip


def run_sleep(timing: Timing, console: Console) -> dict[str, Any]:
    results, rows = measure_table(
        console,
        "SleepEnv (1 ms) x 32",
        sleep_cases(),
        Workload.of(SleepEnv, 32),
        timing,
        [
            Versus("vs ideal", IDEAL, "ratio_to_ideal"),
            Versus("vs for-loop", LOOP, "ratio_to_for_loop"),
        ],
    )
    ideal = median_of(results, IDEAL)
    ideal_row = results.get(IDEAL)
    step_ms = ideal_row.info.get("mean_step_ms") if not isinstance(ideal_row, str | None) else None
    console.print(
        f"measured SleepEnv step: {fmt(step_ms, '.3f')} ms, so ideal = 32 / step = "
        f"{fmt(ideal, ',.0f')} steps/s"
    )
    value = ratio(median_of(results, "envfleet thread"), ideal)
    pinned = ratio(median_of(results, THREAD_PINNED), ideal)
    bare = ratio(median_of(results, BARE_PINNED), ideal)
    met = target(console, "envfleet thread / ideal", value, SLEEP_TARGET, end="")["met"]
    console.print(
        f"pinned to 1 core: {fmt(pinned)}; bare Python threads, pinned (the ceiling here): "
        f"{fmt(bare)}\n"
    )
    return {
        "env": "bench.envs.SleepEnv(sleep_s=0.001)",
        "num_envs": 32,
        "measured_step_ms": step_ms,
        "ideal_steps_per_s": ideal,
        "thread_over_ideal": value,
        "thread_pinned_over_ideal": pinned,
        "bare_threads_pinned_over_ideal": bare,
        "target": SLEEP_TARGET,
        "meets_target": met,
        "runners": rows,
    }


def run_gil(timing: Timing, console: Console) -> dict[str, Any]:
    # 1. Load-independent: does this thread keep running while another is inside the call?
    probe = gil_probe(PROBES, timing, console)
    act = probe[f"ale.act, {LONG_ACT_FRAMES} frames a call"]["ratio_to_sleep"]
    released = act is not None and act >= 0.5
    verdict = (
        f"ale.act {'releases' if released else 'holds'} the GIL while it emulates: "
        f"this thread keeps {fmt(act)} of its speed while another is inside a "
        f"{LONG_ACT_FRAMES}-frame act (sleep: 1.00, sum(range): "
        f"{fmt(probe[HOLDS]['ratio_to_sleep'])})"
    )
    console.print(f"[bold]{verdict}[/bold]\n")
    out: dict[str, Any] = {"progress_probe": probe, "runners": {}, "verdicts": {}}
    out.update(ale_act_releases_gil=released, verdict=verdict)
    # 2. Throughput: 1 thread, 2 threads, 2 processes (needs free cores to mean anything).
    steppers = {"Pong env.step": pong_stepper, "ale.act": ale_act_stepper}
    cases = [case for label, step in steppers.items() for case in scaling_cases(label, step)]
    with progress(console, "gil: threads vs processes") as hooks:
        results = measure_cases(cases, Workload.of("ALE/Pong-v5", 1), timing, console, **hooks)
    for label in steppers:
        one = median_of(results, f"{label}: 1 thread")
        out["runners"].update(
            results_table(
                console,
                f"{label}: 1 thread, 2 threads, 2 processes, each its own env "
                f"({timing.repeats} x {timing.seconds:g} s, median; calls/s)",
                [c.name for c in cases if c.name.startswith(label)],
                results,
                [versus("vs 1 thread", one)],
            )
        )
        threads = ratio(median_of(results, f"{label}: 2 threads"), one)
        procs = ratio(median_of(results, f"{label}: 2 processes"), one)
        scaling = scaling_verdict(threads, procs)
        console.print(f"[bold]{label}: {scaling}[/bold]\n")
        out["verdicts"][label] = {
            "two_threads_over_one": threads,
            "two_processes_over_one": procs,
            "verdict": scaling,
        }
    return out


def run_pong(timing: Timing, console: Console) -> dict[str, Any]:
    results, rows = measure_table(
        console,
        "ALE/Pong-v5 x 8 (agent steps/s)",
        pong_cases(),
        Workload.of("ALE/Pong-v5", 8),
        timing,
        [Versus("vs for-loop", LOOP, "ratio_to_for_loop")],
    )
    loop = median_of(results, LOOP)
    value = ratio(median_of(results, "envfleet thread"), loop)
    met = target(console, "envfleet thread / for-loop", value, PONG_TARGET)["met"]
    return {
        "env": "ALE/Pong-v5",
        "num_envs": 8,
        "thread_over_for_loop": value,
        "target": PONG_TARGET,
        "meets_target": met,
        "runners": rows,
    }


PARTS: dict[str, Callable[[Timing, Console], dict[str, Any]]] = {
    "sleep": run_sleep,
    "gil": run_gil,
    "pong": run_pong,
}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", RESULTS / "thread_bench.json")
    add_choice(parser, "--parts", list(PARTS))
    args = parser.parse_args(argv)
    timing = timing_from(args)
    with session(args.json, width=140) as console:
        report: dict[str, Any] = {
            "machine": print_machine(console),
            "timing": timing.as_dict(),
            "free_threaded_python": free_threaded_probe(),
            "ale_py": version("ale-py"),
            "parts": {part: PARTS[part](timing, console) for part in args.parts},
        }
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
