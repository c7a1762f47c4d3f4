"""Where a pool's node sub-pools go: which Ray nodes, and how many of its workers on each.

The pool's workers are laid over the chosen nodes in contiguous runs (:func:`place`), so that a
node's envs are consecutive rows of the batch (:mod:`envfleet.backends.nodes.transport`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.session import pool_node


def node_cpus(node: dict[str, Any]) -> float:
    """The CPUs of ``node`` (an entry of ``ray.nodes()``)."""
    return float(node.get("Resources", {}).get("CPU", 0.0))


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's alive nodes that have CPUs, in a stable order (the head first as Ray lists it)."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n for n in nodes if n.get("Alive") and node_cpus(n) > 0]


def place(nodes: Sequence[tuple[str, float]], workers: int) -> list[list[int]]:
    """Lay ``workers`` (consecutive indices) over ``nodes`` (id, CPUs) in contiguous runs: one
    each, the rest in proportion to their CPUs (largest remainder); with fewer workers than
    nodes, the nodes with the most CPUs get one."""
    n = len(nodes)
    weights = [max(cpus, 1e-9) for _, cpus in nodes]
    if workers < n:
        chosen = set(sorted(range(n), key=lambda k: -weights[k])[:workers])
        counts = [int(k in chosen) for k in range(n)]
    else:
        rest = workers - n
        shares = [rest * w / sum(weights) for w in weights]
        counts = [1 + int(s) for s in shares]
        by_remainder = sorted(range(n), key=lambda k: int(shares[k]) - shares[k])
        for k in by_remainder[: workers - sum(counts)]:
            counts[k] += 1
    runs, start = [], 0
    for count in counts:
        runs.append(list(range(start, start + count)))
        start += count
    return runs


def split_here(
    chosen: Sequence[tuple[str, float]], runs: Sequence[list[int]], here: str | None
) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The workers of ``runs`` (one run per node of ``chosen``) on the pool's own node ``here``,
    and every other node with its workers (a node given none left out)."""
    mine: list[int] = []
    others: list[tuple[str, list[int]]] = []
    for (node_id, _), workers in zip(chosen, runs, strict=True):
        if node_id == here:
            mine = workers
        elif workers:
            others.append((node_id, workers))
    return mine, others


def has_room(node: dict[str, Any], resources: dict[str, Any]) -> bool:
    """Whether ``node`` has (in all, not free now) the resources one actor asks for:
    ``num_gpus`` and the custom ``resources`` of ``.options()``."""
    total = node.get("Resources", {})
    wanted = dict(resources.get("resources") or {})
    if resources.get("num_gpus"):
        wanted["GPU"] = resources["num_gpus"]
    return all(float(total.get(name, 0.0)) >= float(amount) for name, amount in wanted.items())


def choose_nodes(
    wanted: str | Sequence[str], resources: dict[str, Any] | None = None
) -> list[tuple[str, float]]:
    """The nodes a pool asked for with their CPUs: ``"auto"``, every alive node with CPUs (and
    the resources an agent asks for, ``resources``), or a list of node ids."""
    nodes = alive_nodes()
    if isinstance(wanted, str):
        if wanted != "auto":
            raise ValueError(f"nodes must be 'auto' or a list of Ray node ids, got {wanted!r}")
        room = dict(resources or {})
        chosen = [(str(n["NodeID"]), node_cpus(n)) for n in nodes if has_room(n, room)]
        if not chosen:
            raise ValueError(f"no alive node of this Ray cluster has CPUs and {room}")
        return chosen
    alive = {str(n["NodeID"]): node_cpus(n) for n in nodes}
    unknown = [n for n in wanted if n not in alive]
    if unknown:
        raise ValueError(f"nodes {unknown} are not alive nodes of this Ray cluster")
    return [(n, alive[n]) for n in wanted]


def spans_nodes(extra: RayOptions) -> bool:
    """Whether a pool that left ``nodes`` to us runs node sub-pools (see
    :attr:`RayOptions.nodes`): this process is on a node of the cluster (not a Ray Client
    connection, whose process cannot reach the nodes' agents), the actors' placement is ours,
    and more than one alive node has CPUs and what ``worker_resources`` asks for."""
    resources = dict(extra.worker_resources)
    if not extra.ray_shared_memory or {"scheduling_strategy", "placement_group"} & set(resources):
        return False
    if pool_node() is None:  # a Ray Client connection: this process is on no node
        return False
    return sum(has_room(node, resources) for node in alive_nodes()) > 1


__all__ = [
    "alive_nodes",
    "choose_nodes",
    "has_room",
    "node_cpus",
    "place",
    "spans_nodes",
    "split_here",
]
