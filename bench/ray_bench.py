"""The ray backend against plain Ray patterns and the process backend, side by side in one run.

Runners (random actions, after warm-up; timed windows interleaved across runners so that a
change in the machine's load hits them all; the median window is reported):

- ``naive-ray``, ``batched-ray``: plain Ray patterns (:mod:`envfleet.benchmark.ray_patterns`):
  one actor per env and a call per env step; the envs split by hand over one actor per usable
  core, a call per actor stepping all of its envs (what envfleet's ray backend automates);
- ``envfleet-ray``: ``envfleet.make(..., backend="ray")`` joining the Ray this script started
  (its actors are on this machine: they share the batch memory and take commands over a socket);
- ``envfleet-ray-calls``: the same with ``ray_shared_memory=False``: a Ray call per command, the
  path actors on other machines of a cluster take;
- ``envfleet-process``: ``envfleet.make(..., backend="process")``, the reference.

Workloads: CartPole-v1 x 64 and ALE/Pong-v5 x 8. Targets: envfleet-ray at least 0.8x
envfleet-process on Pong, and at least 5x naive-ray on CartPole. Ray's start-up (``ray.init``
of a local Ray) is timed apart from everything else. Prints a table per workload and writes
every number, with machine info, to ``bench/results/ray.json``.

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/ray_bench.py            # 3 windows of 3 s per runner: 2-3 minutes here
    python bench/ray_bench.py --quick    # 1 window of 0.5 s
    python -m bench.ray_bench --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json
import time
from collections.abc import Callable
from typing import Any

import ray
from rich.console import Console

from bench import envs
from envfleet import benchmark
from envfleet.benchmark import Runner, Timing, Workload, ray_patterns
from envfleet.benchmark.cases import (
    Case,
    median_of,
    ratio,
    save_json,
    script_parser,
    timing_from,
)
from envfleet.benchmark.scripts import Versus, add_choice, measure_table, print_machine, target

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "ray.json"
BENCH_WORKLOADS = ("cartpole", "pong")


RUNNERS: dict[str, Callable[[Workload, Timing], Runner]] = {
    "naive-ray": ray_patterns.open_naive_ray,
    "batched-ray": ray_patterns.open_batched_ray,
    "envfleet-ray": benchmark.envfleet_opener("ray", "envfleet-ray", ray_shared_memory=True),
    "envfleet-ray-calls": benchmark.envfleet_opener(
        "ray", "envfleet-ray-calls", ray_shared_memory=False
    ),
    "envfleet-process": benchmark.RUNNERS["process"].open,
}
"""Every runner by name, in the order they are opened and shown."""

RAY_TARGETS = {
    "cartpole": ("envfleet-ray", "naive-ray", 5.0),
    "pong": ("envfleet-ray", "envfleet-process", 0.8),
}
"""Per workload: (runner, baseline, the least ratio of their throughputs that meets it)."""


def run(name: str, timing: Timing, console: Console) -> dict[str, Any]:
    """Measure every runner on the workload ``name``, print its table; its JSON entry."""
    case = envs.TARGETS[name]
    workload = Workload.of(case.env, case.num_envs)
    subject, baseline, minimum = RAY_TARGETS[name]
    cases = [Case(runner, opener) for runner, opener in RUNNERS.items()]
    title = f"{workload.label} x {workload.num_envs} (env-steps/s)"
    columns = [Versus(f"vs {baseline}", baseline)]
    results, rows = measure_table(console, title, cases, workload, timing, columns)
    base = median_of(results, baseline)
    value = ratio(median_of(results, subject), base)
    met = target(console, f"{subject} / {baseline}", value, minimum)
    return {"env": workload.label, "num_envs": workload.num_envs, "runners": rows, "target": met}


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__ or "", DEFAULT_JSON)
    add_choice(parser, "--workloads", BENCH_WORKLOADS)
    parser.add_argument(
        "--ray-system-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="ray.init(_system_config=...) of the local Ray, e.g. "
        '\'{"worker_niceness": 0, "max_direct_call_object_size": 4194304}\' (Ray runs its '
        "workers at nice 15 and sends results over 100 KB through its object store)",
    )
    args = parser.parse_args(argv)
    timing = timing_from(args)
    console = Console()
    machine = print_machine(console, ("ray", "ale-py"))
    if ray.is_initialized():
        raise SystemExit("run this with no Ray connected: it times Ray's start-up")
    start = time.perf_counter()
    # address="local": a Ray of its own, never a cluster someone else started on this machine.
    tuning = {"_system_config": args.ray_system_config} if args.ray_system_config else {}
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **tuning)
    ray_startup_s = time.perf_counter() - start
    console.print(
        f"Ray start-up (ray.init of a local Ray): {ray_startup_s:.2f} s"
        + (f"; _system_config={args.ray_system_config}" if args.ray_system_config else "")
        + "\n"
    )
    try:
        entries = {name: run(name, timing, console) for name in args.workloads}
    finally:
        ray.shutdown()
    output = {
        "machine": machine,
        "timing": timing.as_dict(),
        "ray_startup_s": ray_startup_s,
        "ray_system_config": args.ray_system_config or {},
        "workloads": entries,
    }
    save_json(args.json, output, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
