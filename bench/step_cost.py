"""CPU per vector step of envfleet's process backend, by process, against the bare pool.

One machine, 2 workers (``--workers``): no-op envs (:class:`bench.envs.NoOpEnv`) x 2 and x 64,
CartPole-v1 x 64 and ALE/Pong-v5 x 8 (:data:`WORKLOADS`), each pool beside the bare pool on as
many workers (:class:`envfleet.benchmark.BarePool`: actions and rows in shared memory,
autoreset) stepped with the same actions, in paired rounds that alternate which goes first
(:func:`envfleet.benchmark.versus_bare`). Per role (the driver, each worker), the CPU µs per
step of both, read from every process before and after each window, and their ratio; then the
wall time and the targets (:data:`TARGETS`).

Usage::

    python bench/step_cost.py                         # all four: 7 rounds of 1 s, ~3 minutes
    python bench/step_cost.py --workloads noop-2,noop-64 --rounds 9 --seconds 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
from typing import Any

from rich.console import Console

import envfleet
from bench import common
from bench.envs import NoOpEnv
from envfleet import benchmark

WORKLOADS: dict[str, tuple[Any, int]] = {
    "noop-2": (NoOpEnv, 2),
    "noop-64": (NoOpEnv, 64),
    "cartpole-64": ("CartPole-v1", 64),
    "pong-8": ("ALE/Pong-v5", 8),
}
TARGETS = {  # workload: (figure, bound): CPU of every process at most, or throughput at least
    "noop-2": ("all processes", 1.3),
    "noop-64": ("all processes", 1.15),
    "cartpole-64": ("throughput", 0.95),
    "pong-8": ("throughput", 0.95),
}


def check(console: Console, name: str, compared: dict[str, Any]) -> dict[str, Any]:
    """Print ``name``'s target (envfleet over bare: CPU, or throughput = bare's wall over
    envfleet's) as met or missed; its JSON."""
    figure, bound = TARGETS[name]
    if figure == "throughput":
        wall = compared["wall"]["ratio"]
        value, met = 1 / wall, 1 / wall >= bound
        shown = f"throughput envfleet / bare = {value:.2f} (target >= {bound})"
    else:
        value = compared[figure]["ratio"]
        met = value <= bound
        shown = f"CPU of every process, envfleet / bare = {value:.2f} (target <= {bound})"
    console.print(f"[bold]{name}: {shown}[/bold] " + ("[green]met" if met else "[red]missed"))
    return {"figure": figure, "value": value, "bound": bound, "met": met}


def measure(console: Console, name: str, args: argparse.Namespace) -> dict[str, Any]:
    env, n = WORKLOADS[name]
    workload = benchmark.Workload.of(env, n)
    timing = benchmark.Timing(seed=args.seed)
    with envfleet.make(env, n, backend="process", num_workers=args.workers) as pool:
        pool.reset(seed=args.seed)
        actions = benchmark.sample_actions(pool.single_action_space, n, timing)[:64]
        bare = benchmark.BarePool(workload, timing, args.workers)
        try:
            with common.progress(console, name) as hooks:
                hook = hooks.get("progress") or hooks["on_stage"]
                mine, theirs = benchmark.versus_bare(
                    pool, bare, actions, args.rounds, args.seconds, hook
                )
        finally:
            bare.close()
    compared = benchmark.compare(mine, theirs)
    title = f"{name} on {args.workers} workers, medians of {args.rounds} paired rounds"
    console.print(benchmark.roles_table(title, compared))
    return {"roles": compared, "target": check(console, name, compared)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    common.add_choice(parser, "--workloads", list(WORKLOADS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds")
    parser.add_argument("--seconds", type=float, default=1.0, help="a window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 0.2 s")
    parser.add_argument("--json", type=Path, default=common.RESULTS / "step_cost.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 0.2
    with common.script_run(args.json) as (console, document):
        document.update(workers=args.workers, rounds=args.rounds, seconds=args.seconds)
        document["workloads"] = {name: measure(console, name, args) for name in args.workloads}
    return 0


if __name__ == "__main__":
    sys.exit(main())
