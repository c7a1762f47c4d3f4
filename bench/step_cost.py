"""CPU per vector step of envfleet's pools, by process, against the bare layouts and against
the VectorEnvs they host alone.

:data:`WORKLOADS` on one machine (2 workers, ``--workers``) and over 2 nodes of a fake Ray
cluster (``noop-64-nodes``: 8 workers), each against the bare layout of as many workers
(:class:`envfleet.benchmark.BarePool`, across nodes at the pool's agents' niceness); named only,
Pong x 16 hosted (:data:`HOSTED`) against the same VectorEnv alone in this process
(``pong-16-ale``: ale-vector's ``AtariVectorEnv`` on a thread per core, hosted a worker per core
on one thread each; ``pong-16-make_vec``: ``gymnasium.make_vec``'s). Both sides step the same
actions in paired rounds that alternate which goes first (:func:`envfleet.benchmark.versus`):
per role (the driver: this process, every thread; each agent; each worker) the CPU µs per step
of both and their ratio, the wall time and the targets (:data:`TARGETS`).

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/step_cost.py                         # the first five: 7 rounds of 1 s, ~4 min
    python bench/step_cost.py --workloads noop-2,noop-64 --rounds 9 --seconds 2
    python bench/step_cost.py --workloads pong-16-ale,pong-16-make_vec --rounds 9
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
from typing import Any

import gymnasium
import psutil
from rich.console import Console

import envfleet
from bench import common
from bench.envs import NoOpEnv
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.spec import EnvSpec

WORKLOADS: dict[str, tuple[Any, int, int]] = {  # env, envs, fake nodes (0: this machine)
    "noop-2": (NoOpEnv, 2, 0),
    "noop-64": (NoOpEnv, 64, 0),
    "cartpole-64": ("CartPole-v1", 64, 0),
    "pong-8": ("ALE/Pong-v5", 8, 0),
    "noop-64-nodes": (NoOpEnv, 64, 2),
    "pong-16-ale": ("ALE/Pong-v5", 16, 0),
    "pong-16-make_vec": ("ALE/Pong-v5", 16, 0),
}
HOSTED = ("pong-16-ale", "pong-16-make_vec")
"""The workloads hosted as VectorEnvs, set against the VectorEnv alone (not the bare layout)."""
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
        for figure, bound in TARGETS.get(name, {}).items()
    ]


def hosted(name: str, n: int) -> tuple[envfleet.Pool, Any]:
    """The pool hosting ``n`` Pong VectorEnvs for workload ``name`` and the same alone."""
    if name == "pong-16-ale":
        spec = EnvSpec.from_user("ALE/Pong-v5")
        fns = benchmark.ale_hosted_fns(spec, n, len(usable_cpus()))
        pool = envfleet.make(vector_env_fns=fns, backend="process")
        return pool, benchmark.ale_vector(spec, n)
    mode = {"vectorization_mode": "vector_entry_point"}
    alone = gymnasium.make_vec("ALE/Pong-v5", n, **mode)  # type: ignore[arg-type]
    return envfleet.make("ALE/Pong-v5", n, backend="process", **mode), alone


def measure(console: Console, name: str, args: argparse.Namespace, nodes: list[str]) -> Any:
    env, n, on_nodes = WORKLOADS[name]
    timing = benchmark.Timing(seed=args.seed)
    where = {"backend": "process", "num_workers": args.workers}
    if on_nodes:
        where = {"backend": "ray", "nodes": nodes[:on_nodes], "num_workers": NODE_WORKERS}
    pool, other = hosted(name, n) if name in HOSTED else (envfleet.make(env, n, **where), None)
    workers = pool.num_workers
    try:
        pool.reset(seed=args.seed)
        actions = benchmark.sample_actions(pool.single_action_space, n, timing)[:64]
        if other is None:  # the bare layout of as many workers, at the agents' niceness
            nice = benchmark.pool_roles(pool)["agent 0"][0].nice() if on_nodes else None
            other = benchmark.BarePool(
                benchmark.Workload.of(env, n), timing, workers, on_nodes, nice
            )
            layout = benchmark.bare_layout(other)
        else:
            other.reset(seed=args.seed)
            layout = benchmark.Layout(
                "alone", other.step, benchmark.roles(psutil.Process(), [], [])
            )
        with common.progress(console, name) as hooks:
            hook = hooks.get("progress") or hooks["on_stage"]
            compared = benchmark.versus(pool, layout, actions, args.rounds, args.seconds, hook)
    finally:
        pool.close()
        if other is not None:
            other.close()
    title = f"{name} on {workers} workers, medians of {args.rounds} paired rounds"
    console.print(benchmark.roles_table(title, compared))
    return {"roles": compared, "targets": check(console, name, compared, on_nodes)}


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "step_cost.json", rounds=7)
    default = [name for name in WORKLOADS if name not in HOSTED]
    common.add_choice(parser, "--workloads", list(WORKLOADS), default)
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
