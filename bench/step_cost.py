"""CPU per vector step of envfleet's pools, by process, against the bare layouts.

No-op envs (:class:`bench.envs.NoOpEnv`) x 2 and x 64, CartPole-v1 x 64 and ALE/Pong-v5 x 8 on
one machine, 2 workers (``--workers``), and no-op x 64 on 8 workers over 2 nodes of a fake Ray
cluster (``noop-64-nodes``; :data:`WORKLOADS`). Each pool beside the bare layout of as many
workers (:class:`envfleet.benchmark.BarePool`: actions and rows in shared memory, autoreset;
across nodes an agent per node, at the pool's agents' niceness, and one TCP message each way)
stepped with the same actions, in paired rounds that alternate which goes first
(:func:`envfleet.benchmark.versus_bare`). Per role (the driver, each agent, each worker), the
CPU µs per step of both, read from every process before and after each window, and their
ratio; then the wall time and the targets (:data:`TARGETS`).

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/step_cost.py                         # all five: 7 rounds of 1 s, ~4 minutes
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

WORKLOADS: dict[str, tuple[Any, int, int]] = {  # env, envs, fake nodes (0: this machine)
    "noop-2": (NoOpEnv, 2, 0),
    "noop-64": (NoOpEnv, 64, 0),
    "cartpole-64": ("CartPole-v1", 64, 0),
    "pong-8": ("ALE/Pong-v5", 8, 0),
    "noop-64-nodes": (NoOpEnv, 64, 2),
}
NODE_WORKERS = 8
"""Workers of the node layout, over its 2 nodes."""
TARGETS: dict[str, dict[str, float]] = {  # envfleet / bare: CPU at most, throughput at least
    "noop-2": {"all processes": 1.3},
    "noop-64": {"all processes": 1.15},
    "cartpole-64": {"throughput": 0.95},
    "pong-8": {"throughput": 0.95},
    # and the driver's CPU per node per step at most 50 µs
    "noop-64-nodes": {"all processes": 1.5, "each agent": 1.5, "driver per node us": 50.0},
}


def check(console: Console, name: str, compared: dict[str, Any], nodes: int) -> list[Any]:
    """Print ``name``'s targets (:data:`TARGETS`) as met or missed; their JSON."""
    agents = [v["ratio"] or 0.0 for k, v in compared.items() if k.startswith("agent")]
    figures = {
        "all processes": compared["all processes"]["ratio"],
        "throughput": 1 / compared["wall"]["ratio"],  # bare's wall over envfleet's
        "each agent": max(agents, default=None),
        "driver per node us": compared["driver"]["envfleet_us"] / max(1, nodes),
    }
    return [
        common.target(
            console, f"{name}: {figure}", figures[figure], bound, most=figure != "throughput"
        )
        for figure, bound in TARGETS[name].items()
    ]


def measure(console: Console, name: str, args: argparse.Namespace, nodes: list[str]) -> Any:
    env, n, on_nodes = WORKLOADS[name]
    timing = benchmark.Timing(seed=args.seed)
    where = {"backend": "process", "num_workers": args.workers}
    if on_nodes:
        where = {"backend": "ray", "nodes": nodes[:on_nodes], "num_workers": NODE_WORKERS}
    with envfleet.make(env, n, **where) as pool:
        pool.reset(seed=args.seed)
        actions = benchmark.sample_actions(pool.single_action_space, n, timing)[:64]
        nice = benchmark.pool_roles(pool)["agent 0"][0].nice() if on_nodes else None
        workload, workers = benchmark.Workload.of(env, n), pool.num_workers
        bare = benchmark.BarePool(workload, timing, workers, on_nodes, nice)
        try:
            with common.progress(console, name) as hooks:
                hook = hooks.get("progress") or hooks["on_stage"]
                compared = benchmark.versus_bare(
                    pool, bare, actions, args.rounds, args.seconds, hook
                )
        finally:
            bare.close()
    title = f"{name} on {workers} workers, medians of {args.rounds} paired rounds"
    console.print(benchmark.roles_table(title, compared))
    return {"roles": compared, "targets": check(console, name, compared, on_nodes)}


def main(argv: list[str] | None = None) -> int:
    parser = common.paired_parser(__doc__ or "", common.RESULTS / "step_cost.json", 7)
    common.add_choice(parser, "--workloads", list(WORKLOADS))
    parser.add_argument("--workers", type=int, default=2, help="on one machine")
    args = common.paired_args(parser, argv)
    nodes = max(WORKLOADS[name][2] for name in args.workloads)
    with (
        common.script_run(args.json, ["ray"] if nodes else []) as (console, document),
        common.fake_cluster(nodes + 1 if nodes else 0) as cluster,
    ):
        ids = [node.node_id for node in cluster.worker_nodes] if cluster else []
        document.update(workers=args.workers, rounds=args.rounds, seconds=args.seconds)
        document["workloads"] = {name: measure(console, name, args, ids) for name in args.workloads}
    return 0


if __name__ == "__main__":
    sys.exit(main())
