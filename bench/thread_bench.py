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
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console

from bench.envs import SleepEnv
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import CallRunner, Runner, Timing, Workload, gil
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
from envfleet.benchmark.scripts import (
    IdealRunner,
    Versus,
    add_choice,
    ideal_info,
    measure_table,
    open_envfleet,
    print_machine,
    target,
    version,
    versus,
)

RESULTS = Path(__file__).resolve().parent / "results"
SLEEP_TARGET = 0.8
PONG_TARGET = 1.6
FREE_THREADED_NOTES = (
    "Checked on the 2-core test machine: Debian 12 offers only python3.11 (apt-cache search "
    "python3.13: nothing); pyenv has 3.13.0 built with the GIL (Py_GIL_DISABLED=0) and no "
    "3.13t/3.14t; `uv python install 3.13t` (uv 0.13.9 from PyPI) fails: its builds download "
    "from GitHub and only package registries are reachable. So no free-threaded CPython here."
)

# -- workloads and runners of this script ------------------------------------------------------


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


def pong_stepper(index: int) -> Callable[[], int]:
    """Steps one ``ALE/Pong-v5`` env through Gymnasium (random actions, resets when done)."""
    env = Workload.of("ALE/Pong-v5", 1).spec.build()
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
        Case("bare threads", gil.open_bare_threads),
        Case(BARE_PINNED, lambda w, t: gil.open_bare_threads(w, t, cpus=one_core())),
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
        Case("ale AtariVectorEnv (as ALE/Pong-v5)", ef(open_atari_vector, **ATARI_AS_GYM)),
        Case("ale AtariVectorEnv (84x84 grey x4)", open_atari_vector),
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
    step_ms = ideal_info(results, IDEAL).get("mean_step_ms")
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
    probe = gil.gil_probe(PROBES, timing, console)
    act = probe[f"ale.act, {LONG_ACT_FRAMES} frames a call"]["ratio_to_sleep"]
    released = act is not None and act >= 0.5
    verdict = (
        f"ale.act {'releases' if released else 'holds'} the GIL while it emulates: "
        f"this thread keeps {fmt(act)} of its speed while another is inside a "
        f"{LONG_ACT_FRAMES}-frame act (sleep: 1.00, sum(range): "
        f"{fmt(probe[gil.HOLDS]['ratio_to_sleep'])})"
    )
    console.print(f"[bold]{verdict}[/bold]\n")
    out: dict[str, Any] = {"progress_probe": probe, "runners": {}, "verdicts": {}}
    out.update(ale_act_releases_gil=released, verdict=verdict)
    # 2. Throughput: 1 thread, 2 threads, 2 processes (needs free cores to mean anything).
    steppers = {"Pong env.step": pong_stepper, "ale.act": ale_act_stepper}
    cases = [case for label, step in steppers.items() for case in gil.scaling_cases(label, step)]
    with console.status("gil: threads vs processes ..."):
        results = measure_cases(cases, Workload.of("ALE/Pong-v5", 1), timing, console)
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
        scaling = gil.scaling_verdict(threads, procs)
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
    console = Console(width=max(Console().width, 140))
    report: dict[str, Any] = {
        "machine": print_machine(console),
        "timing": timing.as_dict(),
        "free_threaded_python": {**gil.free_threaded_probe(), "notes": FREE_THREADED_NOTES},
        "ale_py": version("ale-py"),
        "parts": {part: PARTS[part](timing, console) for part in args.parts},
    }
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
