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
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.async_bench import RESULTS, IdealRunner, open_envfleet, version
from bench.envs import SleepEnv, build_env
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import CallRunner, ParallelRunner, Runner, RunResult, Timing, Workload
from envfleet.benchmark.cases import (
    Case,
    cycle,
    discrete_actions,
    fmt,
    measure_cases,
    median_of,
    ratio,
    results_table,
    save_json,
    script_parser,
    timing_from,
)

SLEEP_TARGET = 0.8
PONG_TARGET = 1.6

# -- runners -------------------------------------------------------------------------------------


ATARI_AS_GYM = {
    "img_height": 210,
    "img_width": 160,
    "grayscale": False,
    "stack_num": 1,
    "maxpool": False,
    "noop_max": 0,
    "repeat_action_probability": 0.25,
    "reward_clipping": False,
    "use_fire_reset": False,
}
"""``AtariVectorEnv`` settings that make its envs step like ``gymnasium.make("ALE/Pong-v5")``."""


def open_atari_vector(workload: Workload, timing: Timing, **kwargs: Any) -> Runner:
    """ale-py's C++ ``AtariVectorEnv`` (a thread pool, one thread per usable core)."""
    from ale_py.vector_env import AtariVectorEnv

    n = workload.num_envs
    kwargs.setdefault("num_threads", len(usable_cpus()))
    vec = AtariVectorEnv("pong", n, **kwargs)
    try:
        vec.reset(seed=timing.seed)
        actions = discrete_actions(int(vec.single_action_space.n), n, timing.seed)
    except BaseException:
        vec.close()
        raise
    return CallRunner("atari-vector", cycle(vec.step, actions, n), vec.close, timing, **kwargs)


# -- the ceiling: bare Python threads, no library -------------------------------------------------


def open_bare_threads(workload: Workload, timing: Timing, cpus: list[int] | None = None) -> Runner:
    """The least any Python thread pool can do: one thread per env, every step started by one
    write to a shared eventfd (semaphore mode: each thread takes one), the end signalled by the
    last thread through a lock; no actions, no results, no error handling. ``cpus``: pin the
    env threads there (the caller's thread stays free). What this reaches is the ceiling of
    threads with a GIL on this machine."""
    num_envs = workload.num_envs
    envs = [workload.spec.build() for _ in range(num_envs)]
    for i, e in enumerate(envs):
        e.reset(seed=timing.seed + i)
    bell = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC)
    done = threading.Lock()
    done.acquire()
    count_lock = threading.Lock()
    state = {"left": 0, "stop": False}

    def serve(e: Any) -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        while True:
            os.eventfd_read(bell)
            if state["stop"]:
                return
            e.step(0)
            with count_lock:
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                done.release()

    threads = [threading.Thread(target=serve, args=(e,), daemon=True) for e in envs]
    for thread in threads:
        thread.start()

    def advance() -> int:
        state["left"] = num_envs
        os.eventfd_write(bell, num_envs)
        done.acquire()
        return num_envs

    def close() -> None:
        state["stop"] = True
        os.eventfd_write(bell, num_envs)
        for thread in threads:
            thread.join(1.0)
        os.close(bell)
        for e in envs:
            e.close()

    return CallRunner("bare threads", advance, close, timing, threads=num_envs, cpus=cpus)


# -- the GIL check: k threads or k processes, each stepping its own env ---------------------------


def pong_stepper(index: int) -> Callable[[], int]:
    """Steps one ``ALE/Pong-v5`` env through Gymnasium (random actions, resets when done)."""
    env = build_env("ALE/Pong-v5")
    env.reset(seed=index)
    actions = discrete_actions(int(env.action_space.n), 1, index, count=256)
    state = [0]

    def step() -> int:
        k = state[0]
        _, _, terminated, truncated, _ = env.step(int(actions[k % 256][0]))
        state[0] = k + 1
        if terminated or truncated:
            env.reset()
        return 1

    return step


def ale_act_stepper(index: int) -> Callable[[], int]:
    """Calls ``ALEInterface.act`` directly (one emulator frame per call; resets at game over)."""
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.setInt("random_seed", index)
    ale.loadROM(roms.get_rom_path("pong"))
    moves = ale.getMinimalActionSet()
    rng = np.random.default_rng(index)
    actions = [moves[i] for i in rng.integers(0, len(moves), size=256)]
    state = [0]

    def step() -> int:
        k = state[0]
        ale.act(actions[k % 256])
        state[0] = k + 1
        if ale.game_over():
            ale.reset_game()
        return 1

    return step


def open_parallel(
    workload: Workload,
    timing: Timing,
    *,
    make_step: Callable[[int], Callable[[], int]],
    count: int,
    mode: str,
) -> Runner:
    """``count`` threads (or processes), each stepping its own env; rates summed."""
    threads = mode == "thread"
    return ParallelRunner(f"{count} {mode}", make_step, count, timing, threads=threads, mode=mode)


def gil_cases() -> list[Case]:
    cases = []
    for label, make_step in (("Pong env.step", pong_stepper), ("ale.act", ale_act_stepper)):
        for count, mode in ((1, "thread"), (2, "thread"), (2, "process")):
            name = (
                f"{label}: {count} {mode}{'es' if mode == 'process' else 's'}"
                if count > 1
                else f"{label}: 1 {mode}"
            )
            cases.append(
                Case(
                    name,
                    functools.partial(open_parallel, make_step=make_step, count=count, mode=mode),
                    forks=mode == "process",
                )
            )
    return cases


def gil_verdict(thread_speedup: float | None, process_speedup: float | None) -> str:
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


# -- parts ---------------------------------------------------------------------------------------


THREAD_PINNED = "envfleet thread, pinned to 1 core"
BARE_PINNED = "bare threads, pinned to 1 core"


def one_core() -> list[int]:
    """The core the pinned thread rows pack their env threads on: the last usable one."""
    return [max(os.sched_getaffinity(0))]


TWO_WORKERS: dict[str, Any] = {"backend": "process", "num_workers": 2}


def sleep_cases() -> list[Case]:
    ef = functools.partial
    return [
        Case("ideal (32 x 1 env)", IdealRunner),
        Case("for-loop", benchmark.open_loop),
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
        Case("for-loop", benchmark.open_loop),
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
        Case("ale AtariVectorEnv (as ALE/Pong-v5)", ef(open_atari_vector, **ATARI_AS_GYM)),
        Case("ale AtariVectorEnv (84x84 grey x4)", open_atari_vector),
    ]  # fmt: skip


def run_sleep(timing: Timing, console: Console) -> dict[str, Any]:
    cases = sleep_cases()
    with console.status("sleep: measuring ..."):
        results = measure_cases(cases, Workload.of(SleepEnv, 32), timing, console)
    ideal = median_of(results, "ideal (32 x 1 env)")
    loop = median_of(results, "for-loop")
    rows = results_table(
        console,
        f"SleepEnv (1 ms) x 32 ({timing.repeats} x {timing.seconds:g} s, median)",
        [c.name for c in cases],
        results,
        [
            ("vs ideal", lambda name, r: fmt(ratio(r.median, ideal))),
            ("vs for-loop", lambda name, r: fmt(ratio(r.median, loop))),
        ],
    )
    for row in rows.values():
        if "steps_per_s" in row:
            row["ratio_to_ideal"] = ratio(row["steps_per_s"], ideal)
            row["ratio_to_for_loop"] = ratio(row["steps_per_s"], loop)
    ideal_result = results.get("ideal (32 x 1 env)")
    step_ms = ideal_result.info.get("mean_step_ms") if isinstance(ideal_result, RunResult) else None
    value = ratio(median_of(results, "envfleet thread"), ideal)
    met = None if value is None else value >= SLEEP_TARGET
    mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
    console.print(
        f"measured SleepEnv step: {fmt(step_ms, '.3f')} ms, so ideal = 32 / step = "
        f"{fmt(ideal, ',.0f')} steps/s"
    )
    pinned = ratio(median_of(results, THREAD_PINNED), ideal)
    bare = ratio(median_of(results, BARE_PINNED), ideal)
    console.print(
        f"[bold]envfleet thread / ideal = {fmt(value)}[/bold] (target >= {SLEEP_TARGET}){mark}; "
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


LONG_ACT_FRAMES = 2000
"""Emulator frames per ``ale.act`` call in the progress probe (ALE's ``frame_skip``)."""


def long_act_call() -> Callable[[], None]:
    """One ``ALEInterface.act`` call that emulates ``LONG_ACT_FRAMES`` frames (~0.1-0.3 s)."""
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.setInt("random_seed", 0)
    ale.setInt("frame_skip", LONG_ACT_FRAMES)
    ale.loadROM(roms.get_rom_path("pong"))
    noop = ale.getMinimalActionSet()[0]

    def call() -> None:
        ale.act(noop)
        if ale.game_over():
            ale.reset_game()

    return call


def _holds_gil_call() -> Callable[[], None]:
    """A C call known to keep the GIL: ``sum`` over a range (the 'holds' reference)."""
    return lambda: sum(range(3_000_000))  # type: ignore[func-returns-value]


def _sleep_call() -> Callable[[], None]:
    """A C call known to release the GIL: ``time.sleep`` (the 'releases' reference)."""
    return lambda: time.sleep(0.05)


PROBES: dict[str, Callable[[], Callable[[], object]]] = {
    "time.sleep(0.05) (releases)": _sleep_call,
    "sum(range(3e6)) (holds)": _holds_gil_call,
    f"ale.act, {LONG_ACT_FRAMES} frames a call": long_act_call,
    "Pong env.step": lambda: pong_stepper(0),
}


def main_thread_progress(call: Callable[[], None], seconds: float) -> float:
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
        start = time.perf_counter()
        deadline = start + seconds
        now = start
        while now < deadline:
            loops += 1
            now = time.perf_counter()
    finally:
        stop.set()
        worker.join()
    return loops / (now - start)


def run_gil(timing: Timing, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {"progress_probe": {}, "runners": {}, "verdicts": {}}
    # 1. Load-independent: does this thread keep running while another is inside the call?
    calls = {name: make() for name, make in PROBES.items()}
    rates: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    seconds = max(1.0, timing.seconds)
    with console.status("gil: main-thread progress probe ..."):
        for round_ in range(max(1, timing.repeats)):
            k = round_ % len(names)
            for name in names[k:] + names[:k]:
                rates[name].append(main_thread_progress(calls[name], seconds))
    free = statistics.median(rates["time.sleep(0.05) (releases)"])
    table = Table(
        title=f"GIL probe: main-thread loop while another thread repeats a call "
        f"({max(1, timing.repeats)} x {seconds:g} s, median)",
        title_justify="left",
    )
    for column in ("call in the other thread", "main loops/s", "vs sleep", "windows"):
        table.add_column(column, justify="left" if column.startswith("call") else "right")
    for name, values in rates.items():
        progress = statistics.median(values)
        table.add_row(
            name,
            f"{progress:,.0f}",
            fmt(ratio(progress, free)),
            " ".join(f"{v:,.0f}" for v in values),
        )
        out["progress_probe"][name] = {
            "main_loops_per_s": progress,
            "ratio_to_sleep": ratio(progress, free),
            "windows": values,
        }
    console.print(table)
    act = ratio(statistics.median(rates[f"ale.act, {LONG_ACT_FRAMES} frames a call"]), free)
    released = act is not None and act >= 0.5
    verdict = (
        f"ale.act {'releases' if released else 'holds'} the GIL while it emulates: "
        f"this thread keeps {fmt(act)} of its speed while another is inside a "
        f"{LONG_ACT_FRAMES}-frame act (sleep: 1.00, sum(range): "
        f"{fmt(ratio(statistics.median(rates['sum(range(3e6)) (holds)']), free))})"
    )
    console.print(f"[bold]{verdict}[/bold]\n")
    out["ale_act_releases_gil"] = released
    out["verdict"] = verdict
    # 2. Throughput: 1 thread, 2 threads, 2 processes (needs free cores to mean anything).
    cases = gil_cases()
    with console.status("gil: threads vs processes ..."):
        results = measure_cases(cases, Workload.of("ALE/Pong-v5", 1), timing, console)
    for label in ("Pong env.step", "ale.act"):
        one = median_of(results, f"{label}: 1 thread")
        subset = [c.name for c in cases if c.name.startswith(label)]
        rows = results_table(
            console,
            f"{label}: 1 thread, 2 threads, 2 processes, each its own env "
            f"({timing.repeats} x {timing.seconds:g} s, median; calls/s)",
            subset,
            results,
            [("vs 1 thread", functools.partial(_vs, base=one))],
        )
        threads = ratio(median_of(results, f"{label}: 2 threads"), one)
        procs = ratio(median_of(results, f"{label}: 2 processes"), one)
        scaling = gil_verdict(threads, procs)
        console.print(f"[bold]{label}: {scaling}[/bold]\n")
        out["runners"].update(rows)
        out["verdicts"][label] = {
            "two_threads_over_one": threads,
            "two_processes_over_one": procs,
            "verdict": scaling,
        }
    return out


def _vs(name: str, result: RunResult, base: float | None) -> str:
    return fmt(ratio(result.median, base))


def run_pong(timing: Timing, console: Console) -> dict[str, Any]:
    cases = pong_cases()
    with console.status("pong: measuring ..."):
        results = measure_cases(cases, Workload.of("ALE/Pong-v5", 8), timing, console)
    loop = median_of(results, "for-loop")
    rows = results_table(
        console,
        f"ALE/Pong-v5 x 8 ({timing.repeats} x {timing.seconds:g} s, median; agent steps/s)",
        [c.name for c in cases],
        results,
        [("vs for-loop", lambda name, r: fmt(ratio(r.median, loop)))],
    )
    for row in rows.values():
        if "steps_per_s" in row:
            row["ratio_to_for_loop"] = ratio(row["steps_per_s"], loop)
    value = ratio(median_of(results, "envfleet thread"), loop)
    met = None if value is None else value >= PONG_TARGET
    mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
    console.print(
        f"[bold]envfleet thread / for-loop = {fmt(value)}[/bold] (target >= {PONG_TARGET}){mark}\n"
    )
    return {
        "env": "ALE/Pong-v5",
        "num_envs": 8,
        "thread_over_for_loop": value,
        "target": PONG_TARGET,
        "meets_target": met,
        "runners": rows,
    }


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
    found["notes"] = (
        "Checked on the 2-core dev machine: Debian 12 offers only python3.11 (apt-cache search "
        "python3.13: nothing); pyenv has 3.13.0 built with the GIL (Py_GIL_DISABLED=0) and no "
        "3.13t/3.14t; `uv python install 3.13t` (uv 0.13.9 from PyPI) fails: its builds download "
        "from GitHub and only package registries are reachable. So no free-threaded CPython here."
    )
    return found


PARTS: dict[str, Callable[[Timing, Console], dict[str, Any]]] = {
    "sleep": run_sleep,
    "gil": run_gil,
    "pong": run_pong,
}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", RESULTS / "thread_bench.json")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    timing = timing_from(args)
    console = Console(width=max(Console().width, 140))
    machine = benchmark.machine_info()
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, Python "
        f"{machine['python']}, load average {machine['load_average_at_start'][0]:.2f}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    report: dict[str, Any] = {
        "machine": machine,
        "timing": timing.as_dict(),
        "free_threaded_python": free_threaded_probe(),
        "ale_py": version("ale-py"),
        "parts": {},
    }
    for part in parts:
        report["parts"][part] = PARTS[part](timing, console)
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
