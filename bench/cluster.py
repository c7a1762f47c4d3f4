"""The ray backend across nodes, side by side on a fake cluster (``ray.cluster_utils.Cluster``).

One run, one cluster (a head and 4 worker nodes, all on this machine), every row measured in
turn: the driver's CPU time per vector step (``time.process_time`` of this process, which is
the pool's caller) and the wall time, for

- ``per-actor``: today's path, one Ray actor per worker on the other nodes, one Ray call per
  worker per step (``nodes=False``);
- ``per-actor, 1/node``: one actor per node, so one Ray call carries a node's whole batch (the
  "Ray calls carrying a node's batch" data plane);
- ``node pools``: one agent per node running the node's workers as local processes, one message
  per node per step over the authenticated socket (``nodes=[...]``);
- ``process``: the process backend on one machine, the reference;

against nodes (1, 2, 4), workers and observation size (16 bytes, 84x84x4 and 210x160x3
uint8), and the throughput of envs that sleep 10 ms a step (on threads, so the two cores here
are not the limit) with N nodes against one. ``--quick`` runs fewer steps.

    PYTHONPATH=. python bench/cluster.py --quick
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any, ClassVar

import gymnasium
import numpy as np
import ray
from gymnasium import spaces
from ray.cluster_utils import Cluster

import envfleet

SHAPES = {
    "16 B": ((4,), np.float32),
    "84x84x4": ((84, 84, 4), np.uint8),
    "210x160x3": ((210, 160, 3), np.uint8),
}


class ShapedNoOp(gymnasium.Env[np.ndarray, int]):
    """Does nothing; its observation is a constant array of ``shape`` and ``dtype``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...] = (4,), dtype: Any = np.float32, sleep: float = 0.0):
        high = 255 if dtype == np.uint8 else np.inf
        low = 0 if dtype == np.uint8 else -np.inf
        self.observation_space = spaces.Box(low, high, shape=shape, dtype=dtype)
        self.action_space = spaces.Discrete(2)
        self._obs = np.ones(shape, dtype=dtype)
        self._sleep = sleep

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: int) -> Any:
        if self._sleep:
            time.sleep(self._sleep)
        return self._obs, 0.0, False, False, {}


def measure(pool: envfleet.Pool, steps: int, repeats: int) -> tuple[float, float, float]:
    """Best of ``repeats``, per vector step: wall ms, driver CPU ms (the whole process: Ray's
    own threads in it too) and the caller's thread CPU ms (the pool's own work)."""
    actions = np.ones(pool.num_envs, dtype=np.int64)
    pool.reset(seed=0)
    for _ in range(max(5, steps // 10)):
        pool.step(actions)
    best = (float("inf"), float("inf"), float("inf"))
    for _ in range(repeats):
        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(steps):
            pool.step(actions)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        own = time.thread_time() - own
        best = min(best, (wall * 1e3 / steps, cpu * 1e3 / steps, own * 1e3 / steps))
    return best


def row(name: str, envs: int, wall: float, cpu: float, own: float, **extra: Any) -> dict[str, Any]:
    result = {"row": name, "envs": envs, "ms/step": wall, "driver CPU ms/step": cpu}
    result["thread CPU ms/step"] = own
    result["env-steps/s"] = envs / wall * 1e3
    result.update(extra)
    print(
        f"{name:<44} envs={envs:<4} {wall:8.3f} ms/step  driver CPU {cpu:7.3f} ms/step "
        f"(its thread {own:7.3f})  {result['env-steps/s']:10.0f} env-steps/s",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a few seconds a row)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    steps = 200 if args.quick else 1000
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 << 20},
    )
    try:
        for k in range(4):
            cluster.add_node(
                num_cpus=1, resources={"pair": 100} if k < 2 else {}, object_store_memory=80 << 20
            )
        ray.init(address=cluster.address, log_to_driver=False)
        workers = [n.node_id for n in cluster.worker_nodes]
        rows = []
        noop = functools.partial(ShapedNoOp, (4,), np.float32)
        common: dict[str, Any] = {"backend": "ray", "seed": 0}
        with envfleet.make(noop, 64, backend="process", num_workers=2, seed=0) as pool:
            rows.append(
                row("process, 1 machine, 2 workers", 64, *measure(pool, steps, args.repeats))
            )
        for n in (1, 2, 4):
            with envfleet.make(noop, 64, num_workers=2 * n, nodes=workers[:n], **common) as pool:
                rows.append(
                    row(
                        f"node pools, {n} node(s) x 2 workers",
                        64,
                        *measure(pool, steps, args.repeats),
                        nodes=n,
                    )
                )
        for w in (2, 8):
            with envfleet.make(
                noop,
                64,
                num_workers=w,
                worker_resources={"resources": {"pair": 1}},
                nodes=False,
                **common,
            ) as pool:
                label = (
                    "per-actor, 1/node (Ray call per node)" if w == 2 else "per-actor, 8 on 2 nodes"
                )
                rows.append(row(label, 64, *measure(pool, steps, args.repeats), nodes=2))
        with envfleet.make(noop, 64, num_workers=8, nodes=workers[:2], **common) as pool:
            rows.append(
                row(
                    "node pools, 8 workers on 2 nodes",
                    64,
                    *measure(pool, steps, args.repeats),
                    nodes=2,
                )
            )
        for label, (shape, dtype) in SHAPES.items():
            if label == "16 B":
                continue
            env = functools.partial(ShapedNoOp, shape, dtype)
            with envfleet.make(env, 16, num_workers=4, nodes=workers[:2], **common) as pool:
                rows.append(
                    row(
                        f"node pools, 2 nodes, obs {label}",
                        16,
                        *measure(pool, steps // 4, args.repeats),
                    )
                )
            with envfleet.make(
                env,
                16,
                num_workers=2,
                worker_resources={"resources": {"pair": 1}},
                nodes=False,
                **common,
            ) as pool:
                rows.append(
                    row(
                        f"per-actor 1/node, 2 nodes, obs {label}",
                        16,
                        *measure(pool, steps // 4, args.repeats),
                    )
                )
        sleepy = functools.partial(ShapedNoOp, (4,), np.float32, 0.01)
        base = None
        for n in (1, 2, 4):
            with envfleet.make(
                sleepy, 32 * n, num_workers=n, threads_per_worker=32, nodes=workers[:n], **common
            ) as pool:
                timing = measure(pool, max(20, steps // 10), args.repeats)
                r = row(f"sleep 10 ms, {n} node(s) x 32 envs", 32 * n, *timing)
                base = base or r["env-steps/s"]
                r["vs one node"] = r["env-steps/s"] / base
                print(f"{'':44} {r['vs one node']:.2f}x one node (target >= {0.8 * n:.1f}x)")
                rows.append(r)
        one = next(r for r in rows if r["row"].startswith("node pools, 1 node"))
        four = next(r for r in rows if r["row"].startswith("node pools, 4 node"))
        for key in ("driver CPU ms/step", "thread CPU ms/step"):
            per_node = (four[key] - one[key]) / 3
            print(f"\n{key[:-8]} per extra node per step: {per_node * 1e3:.0f} us (target <= 100)")
        process = rows[0]["env-steps/s"]
        eight = next(r for r in rows if r["row"] == "node pools, 8 workers on 2 nodes")
        print(
            "no-op x 64, 8 workers on 2 nodes vs process backend: "
            f"{eight['env-steps/s'] / process:.3f}x (target >= 0.25x)"
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
