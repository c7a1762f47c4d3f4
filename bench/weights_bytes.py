"""Bytes a policy's versions put through the worker processes' pipes, segments on and off.

A policy of 10 MB of weights (``weights()``/``load_weights``): its first version (code, which
holds the weights too, and weights) and a new one (weights). Counted:
what each worker process reads (``/proc/<pid>/io``'s ``rchar``: its pipe, its envs read no
file), summed over the workers of the machine (process backend: 1 and 4 workers) or of each
node (``--nodes``: two fake nodes of 4 workers, ``ray.cluster_utils``; also what the pool sent
each node). ``--off``: the segments turned off, each worker gets its own copy down its pipe (as
before they existed).

    PYTHONPATH=. python bench/weights_bytes.py [--nodes] [--off] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from typing import Any

import numpy as np
import psutil

import envfleet
from bench import common
from envfleet.backends.local import shared_weights


class Big:
    """10 MB of weights; actions from the 32 bytes of ``w``. Defined here, not imported from
    the engine: a worker unpickling it reads no module's files beside its pipe."""

    def __init__(self, fill: float) -> None:
        self.w = np.full((4, 2), fill)
        self.big = np.zeros(10 * 2**20 // 8)

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w, "big": self.big}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.w, self.big = weights["w"], weights["big"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.asarray(np.argmax(observations @ self.w, axis=1), dtype=np.int64)


def segments_off() -> None:
    """Each worker its own copy down its pipe (a Ray worker's setup hook for ``--nodes``)."""
    shared_weights.segments_available = lambda: False


def versions(pool: envfleet.Pool, machines: list[list[int]], label: str) -> None:
    """Two versions' rollouts, and the bytes they put through each machine's workers' pipes."""

    def read() -> list[int]:
        return [sum(psutil.Process(p).io_counters().read_chars for p in w) for w in machines]

    def sent() -> list[int]:
        return [n.bytes_out for n in pool.stats().nodes]

    policy = Big(0.5)
    for name, fill in (("first version", 0.5), ("new version", -0.5)):
        policy.w = np.full((4, 2), fill)
        before, out = read(), sent()
        pool.rollout(policy, 2)
        piped = [b - a for a, b in zip(before, read(), strict=True)]
        nodes = [b - a for a, b in zip(out, sent(), strict=True)]
        to_nodes = f", sent to each node {nodes}" if nodes else ""
        print(f"{label}, {name}: read from the workers' pipes {piped}{to_nodes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", action="store_true", help="two fake nodes of 4 workers")
    parser.add_argument("--off", action="store_true", help="segments off: a copy per pipe")
    parser.add_argument("--quick", action="store_true", help="4 workers only (one machine)")
    args = parser.parse_args()
    label = "segments off" if args.off else "segments on"
    if not args.nodes:
        if args.off:
            segments_off()
        for workers in (4,) if args.quick else (1, 4):
            with envfleet.make("CartPole-v1", 8, num_workers=workers, seed=0) as pool:
                pool.reset()
                pids = [pid for pid in pool._transport.pids() if pid is not None]  # type: ignore[attr-defined]
                versions(pool, [pids], f"process, {label}, {workers} workers")
        return
    hook = {"worker_process_setup_hook": "bench.weights_bytes.segments_off"} if args.off else {}
    with common.fake_cluster(3, runtime_env=hook) as cluster:
        nodes = [node.node_id for node in cluster.worker_nodes]
        with envfleet.make(
            "CartPole-v1", 8, backend="ray", num_workers=8, nodes=nodes, seed=0
        ) as pool:
            pool.reset()
            agents = [link.pid for link in pool._transport._nodes]  # type: ignore[attr-defined]
            machines = [
                [g.pid for c in psutil.Process(a).children() for g in c.children()] for a in agents
            ]
            versions(pool, machines, f"2 nodes x 4 workers, {label}")


if __name__ == "__main__":
    main()
