"""Thread backend: sleeping envs and ALE's Pong against the for-loop and the alternatives.

- ``sleep``: :class:`bench.envs.SleepEnv` (1 ms) x 32 against the ideal (one env stepped alone,
  x 32), with bare threads (:func:`open_bare_threads`: the ceiling of Python threads with a GIL)
  beside envfleet. Target: envfleet thread >= 0.8 of the ideal.
- ``pong``: ``ALE/Pong-v5`` x 8. Target: envfleet thread >= 1.6x the for-loop (which it can
  reach only if ale-py releases the GIL while it emulates).

Usage::

    python bench/thread_bench.py                 # both: 3 x 3 s windows, a few minutes
    python bench/thread_bench.py --quick         # smoke run: 1 x 0.5 s window
    python bench/thread_bench.py --parts pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functools
import os
import threading
from typing import Any

from bench import common
from bench.common import Case
from bench.envs import SleepEnv
from envfleet import benchmark
from envfleet.benchmark import CallRunner, Runner, Timing, Workload, open_envfleet


def open_bare_threads(workload: Workload, timing: Timing, cpus: list[int] | None = None) -> Runner:
    """The least any Python thread pool can do: one thread per env, every step started by one
    write to a shared eventfd (semaphore mode: each thread takes one), the end signalled by the
    last thread through a lock; no actions, no results, no error handling. ``cpus``: pin the
    env threads there (the caller's thread stays free)."""
    num_envs = workload.num_envs
    envs = [workload.spec.build() for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=timing.seed + i)
    bell = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC)
    done, count_lock, stop = threading.Lock(), threading.Lock(), threading.Event()
    done.acquire()
    left = [0]

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


ONE_CORE = [max(os.sched_getaffinity(0))]
"""The core the pinned rows pack their env threads on: the last usable one."""


def envfleet(**make_kwargs: Any) -> Any:
    return functools.partial(open_envfleet, **make_kwargs)


TWO = {"backend": "process", "num_workers": 2}
IDEAL, LOOP = "ideal (32 x 1 env)", "for-loop"
SLEEP_CASES = [
    Case(IDEAL, common.open_ideal),
    Case(LOOP, benchmark.open_loop),
    Case("bare threads", open_bare_threads),
    Case("bare threads, pinned to 1 core", functools.partial(open_bare_threads, cpus=ONE_CORE)),
    Case("envfleet thread", envfleet(backend="thread")),
    Case("envfleet thread, pinned to 1 core", envfleet(backend="thread", cpu_affinity=ONE_CORE)),
    Case("envfleet process 2w", envfleet(**TWO), forks=True),
    Case("envfleet process 2w x16t", envfleet(**TWO, threads_per_worker=16), forks=True),
    Case(
        "envfleet process 2w x16t, spread",
        envfleet(**TWO, threads_per_worker=16, cpu_affinity="spread"),
        forks=True,
    ),
    Case("gym AsyncVectorEnv", benchmark.open_gym_async, forks=True),
]
PONG_CASES = [
    Case(LOOP, benchmark.open_loop),
    Case("envfleet thread", envfleet(backend="thread")),
    Case("envfleet process 2w", envfleet(**TWO), forks=True),
    Case("envfleet process 2w, spread", envfleet(**TWO, cpu_affinity="spread"), forks=True),
    Case("envfleet process 2w x4t", envfleet(**TWO, threads_per_worker=4), forks=True),
    Case("gym AsyncVectorEnv", benchmark.open_gym_async, forks=True),
    Case("ale AtariVectorEnv", benchmark.open_ale_vector),
]
PONG = Workload.of("ALE/Pong-v5", 8)
PARTS = {  # title, cases, workload, reference row, least ratio of envfleet thread to it
    "sleep": ("SleepEnv (1 ms) x 32", SLEEP_CASES, Workload.of(SleepEnv, 32), IDEAL, 0.8),
    "pong": ("ALE/Pong-v5 x 8 (agent steps/s)", PONG_CASES, PONG, LOOP, 1.6),
}


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "thread_bench.json")
    common.add_choice(parser, "--parts", list(PARTS))
    args = parser.parse_args(argv)
    timing = common.timing_from(args)
    with common.script_run(args.json, width=140) as (console, report):
        report["parts"] = {}
        for part in args.parts:
            title, cases, workload, reference, minimum = PARTS[part]
            measured = common.measure_table(console, title, cases, workload, timing, reference)
            value = measured.ratio("envfleet thread", workload.num_envs, reference)
            check = common.target(console, f"envfleet thread / {reference}", value, minimum)
            report["parts"][part] = {**common.rows(measured), "target": check}
    return 0


if __name__ == "__main__":
    sys.exit(main())
