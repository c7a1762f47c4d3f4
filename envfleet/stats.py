"""Pool statistics: per-worker latency, idle fraction, steps, episodes and restarts.

Measured in the pool's process, per command: a worker is busy from the moment it has a command
(sent, or queued behind the previous one) until its reply is taken in, so latency includes the
transport. Recording costs one clock read and a few additions per command.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

LATENCY_WINDOW = 1024
"""Commands per worker kept for the latency percentiles."""


@dataclass(frozen=True)
class WorkerStats:
    """One worker's figures since the pool was made."""

    worker: int
    env_ids: tuple[int, ...]
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    idle_fraction: float
    steps: int
    episodes: int
    restarts: int
    recycled: int = 0
    """Times the worker was replaced for going over ``worker_memory_limit``."""
    node: str | None = None
    """The Ray node id of the node that runs the worker, where the pool runs node sub-pools
    (the node of :attr:`PoolStats.nodes` that lists it); ``None`` otherwise."""

    def __str__(self) -> str:
        """One line, rounded: ``worker 0 (envs 0-3): p50 0.41 ms, p99 1.2 ms, idle 12%, ...``."""
        ids = self.env_ids
        if ids and list(ids) == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
            envs = f"envs {ids[0]}-{ids[-1]}"
        else:
            envs = f"env{'s' * (len(ids) != 1)} {','.join(map(str, ids))}"
        p50, p99 = (
            "-" if value is None else f"{value:.3g} ms"
            for value in (self.latency_p50_ms, self.latency_p99_ms)
        )
        text = (
            f"worker {self.worker} ({envs}): latency p50 {p50}, p99 {p99}, "
            f"idle {self.idle_fraction:.0%}, {self.steps:,} steps, {self.episodes:,} episodes, "
            f"{self.restarts:,} restarts"
        )
        return text + (f", {self.recycled} recycled" if self.recycled else "")


@dataclass(frozen=True)
class NodeStats:
    """One node's figures where a pool runs node sub-pools (``backend="ray", nodes=...``)."""

    node: str
    """The Ray node id."""
    address: str
    workers: int
    envs: int
    messages: int
    """Messages the pool sent the node's agent (one per node per whole-pool step)."""
    answers: int
    """Messages the agent sent back."""
    bytes_out: int
    bytes_in: int
    round_trip_ms: float | None
    """Mean time from a message to the node until its answer (``None``: none yet)."""
    shared_memory: bool = False
    """The pool's own node: its workers (one Ray actor each) write their rows in the pool's
    memory and take each command over a local socket, without an agent; ``messages`` and
    ``answers`` count one per worker per command, nothing is copied (``bytes_*`` are 0) and
    ``round_trip_ms`` is ``None``."""
    worker_ids: tuple[int, ...] = ()
    """The pool's workers that run on the node, in order."""
    env_ids: tuple[int, ...] = ()
    """The envs those workers hold (their rows of the batch), in order: consecutive, as a
    node's workers are."""


def env_range(ids: Sequence[int]) -> str:
    """``envs 0-3`` for consecutive ids, else ``envs 0,2``; ``env 5`` for one."""
    if len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"envs {ids[0]}-{ids[-1]}"
    return f"env{'s' * (len(ids) != 1)} {','.join(map(str, ids))}"


def node_layout(nodes: Sequence[NodeStats]) -> str:
    """``repr(pool)``'s node layout, in the order of the rows the nodes hold: each node's id
    (its first 8 characters), envs, workers and which envs."""
    if not nodes:
        return ""
    ordered = sorted(nodes, key=lambda n: n.env_ids[0] if n.env_ids else -1)
    parts = "; ".join(
        f"{n.node[:8]} {n.envs} envs/{n.workers} workers"
        + (f" ({env_range(n.env_ids)})" if n.env_ids else "")
        for n in ordered
    )
    return f", nodes=[{parts}]"


@dataclass(frozen=True)
class PoolStats:
    """What :meth:`envfleet.Pool.stats` returns."""

    seconds: float
    steps: int
    episodes: int
    restarts: int
    workers: tuple[WorkerStats, ...]
    recycled: int = 0
    """Workers replaced for going over ``worker_memory_limit``, in all."""
    nodes: tuple[NodeStats, ...] = ()
    """Per node, where the pool runs node sub-pools, in the order of the rows they hold (each
    with its ``worker_ids`` and ``env_ids``; each worker's ``node`` says it too); empty
    otherwise."""
    rollout_lags: dict[int, int] = field(default_factory=dict)
    """Parts of rollouts handed over (or dropped), by their lag: how many versions of the
    policy's weights behind the newest sent they acted (``Pool.rollout_wait``)."""
    rollout_parts_dropped: int = 0
    rollout_steps_dropped: int = 0
    """Parts (and their env-steps) dropped for acting more than ``max_lag`` versions behind."""

    def __post_init__(self) -> None:
        """Each worker's ``node``, from the node that lists it (:attr:`NodeStats.worker_ids`)."""
        where = {w: node.node for node in self.nodes for w in node.worker_ids}
        if where and any(w.node != where.get(w.worker, w.node) for w in self.workers):
            workers = tuple(replace(w, node=where.get(w.worker, w.node)) for w in self.workers)
            object.__setattr__(self, "workers", workers)

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for JSON."""
        return asdict(self)

    def __str__(self) -> str:
        """Readable and rounded, a line for the pool, then one per worker and per node (the
        fields themselves: ``repr()``, :meth:`as_dict`)."""
        rate = self.steps / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"{self.steps:,} steps in {self.seconds:.1f} s ({rate:,.0f}/s), "
            f"{self.episodes:,} episodes, {self.restarts:,} restarts"
            + (f", {self.recycled} workers recycled" if self.recycled else "")
        ]
        lines += [f"  {worker}" for worker in self.workers]
        for node in self.nodes:
            trip = "-" if node.round_trip_ms is None else f"{node.round_trip_ms:.3g} ms"
            lines.append(
                f"  node {node.node[:8]} ({node.address}): {node.envs} envs on {node.workers} "
                f"workers, {node.messages:,} messages, round trip {trip}"
                + ("" if node.shared_memory else f", {node.bytes_out + node.bytes_in:,} bytes")
            )
        return "\n".join(lines)


class StatsRecorder:
    """Accumulates per-worker figures as the pool submits commands and takes replies.

    Kept in numpy arrays, one row or entry per worker, so that a whole-pool step (every worker
    sent one command at once, every reply taken at once) is recorded in a few array operations
    (:meth:`busy_all`, :meth:`replied_all`) rather than a Python call per worker: with one
    thread per env that per-worker cost ran on the pool's thread, under the GIL, every step.
    """

    def __init__(self, assignment: list[tuple[int, ...]], num_envs: int) -> None:
        self.assignment = assignment
        self.created = time.monotonic()
        self.rollout_lags: dict[int, int] = {}
        self.rollout_parts_dropped = self.rollout_steps_dropped = 0
        workers = len(assignment)
        self.latency = np.zeros((workers, LATENCY_WINDOW))  # a ring per worker
        self.replies = np.zeros(workers, dtype=np.int64)  # commands answered, per worker
        self.busy_seconds = np.zeros(workers)
        self.busy_start = np.full(workers, np.nan)  # NaN: idle
        self.steps = np.zeros(workers, dtype=np.int64)
        self.episodes = np.zeros(num_envs, dtype=np.int64)
        self._sizes = np.array([len(ids) for ids in assignment], dtype=np.int64)
        self._workers = np.arange(workers)
        # Latencies of whole-pool steps not yet written into the arrays (see replied_all).
        self._whole: list[float] = []
        # When the whole-pool step out began (busy_all), not yet written into busy_start.
        self._all_busy_since: float | None = None

    def _settle(self) -> None:
        """Write the start of the whole-pool step out (:meth:`busy_all`) into busy_start."""
        if self._all_busy_since is not None:
            self.busy_start.fill(self._all_busy_since)
            self._all_busy_since = None

    def _fold(self) -> None:
        """Write the whole-pool steps recorded by :meth:`replied_all` into the arrays."""
        whole = self._whole
        if not whole:
            return
        self._whole = []
        count = len(whole)
        # Worker w's k-th pending latency goes to ring slot (replies[w] + k) % LATENCY_WINDOW.
        slots = (self.replies[:, None] + np.arange(count)) % LATENCY_WINDOW
        self.latency[self._workers[:, None], slots] = np.asarray(whole)
        self.replies += count
        self.steps += self._sizes * count
        self.busy_seconds += sum(whole)  # busy_all(started) began every worker's stretch

    def busy(self, worker: int, now: float) -> None:
        """The worker got a command while it had none."""
        self._settle()
        self.busy_start[worker] = now

    def busy_all(self, now: float) -> None:
        """Every worker got a command while it had none (a whole-pool step): noted, and
        written into ``busy_start`` only if a per-worker entry or :meth:`snapshot` reads it
        before :meth:`replied_all` (every worker was idle, and is again after it)."""
        self._all_busy_since = now

    def replied(
        self, worker: int, started: float, now: float, env_steps: int, idle_after: bool
    ) -> None:
        """A reply came in for a command the worker began at ``started``."""
        if self._whole:
            self._fold()
        self._settle()
        count = int(self.replies[worker])
        self.latency[worker, count % LATENCY_WINDOW] = now - started
        self.replies[worker] = count + 1
        self.steps[worker] += env_steps
        if idle_after:
            start = self.busy_start[worker]
            if start == start:  # not NaN
                self.busy_seconds[worker] += now - start
            self.busy_start[worker] = np.nan

    def replied_all(self, started: float, now: float) -> None:
        """Every worker answered the whole-pool step all began at ``started``; all are idle.

        Only the latency is noted here, in a Python list: the arrays are brought up to date
        (:meth:`_fold`) when a per-worker reply or :meth:`snapshot` needs them, or when a
        latency window's worth has piled up, so that the sync step pays one append.
        """
        if self._all_busy_since is None:  # written by a per-worker entry meanwhile
            self.busy_start.fill(np.nan)
        self._all_busy_since = None
        whole = self._whole
        whole.append(now - started)
        if len(whole) >= LATENCY_WINDOW:
            self._fold()

    def ended(self, env_ids: np.ndarray, done: np.ndarray) -> None:
        """Count the episodes that ended among results handed to the caller."""
        if np.count_nonzero(done):  # a C call: ndarray.any goes through Python
            np.add.at(self.episodes, env_ids[done], 1)

    def ended_many(self, counts: np.ndarray) -> None:
        """Count the episodes each env ended in several results at once (a rollout's)."""
        self.episodes += counts

    def snapshot(self, restarts: np.ndarray, recycled: Sequence[int] = ()) -> PoolStats:
        self._fold()
        self._settle()
        now = time.monotonic()
        elapsed = max(now - self.created, 1e-9)
        workers = []
        for w, ids in enumerate(self.assignment):
            busy = float(self.busy_seconds[w])
            start = float(self.busy_start[w])
            if start == start:  # busy now
                busy += now - start
            lat = self.latency[w, : min(int(self.replies[w]), LATENCY_WINDOW)] * 1e3
            workers.append(
                WorkerStats(
                    worker=w,
                    env_ids=ids,
                    latency_p50_ms=float(np.percentile(lat, 50)) if lat.size else None,
                    latency_p99_ms=float(np.percentile(lat, 99)) if lat.size else None,
                    idle_fraction=float(min(1.0, max(0.0, 1.0 - busy / elapsed))),
                    steps=int(self.steps[w]),
                    episodes=int(self.episodes[list(ids)].sum()),
                    restarts=int(restarts[list(ids)].sum()),
                    recycled=int(recycled[w]) if recycled else 0,
                )
            )
        return PoolStats(
            seconds=elapsed,
            steps=int(self.steps.sum()),
            episodes=int(self.episodes.sum()),
            restarts=int(restarts.sum()),
            workers=tuple(workers),
            recycled=int(sum(recycled)),
            rollout_lags=dict(sorted(self.rollout_lags.items())),
            rollout_parts_dropped=self.rollout_parts_dropped,
            rollout_steps_dropped=self.rollout_steps_dropped,
        )

    def rollout_part(self, lag: int, dropped: bool, env_steps: int) -> None:
        """A rollout's part handed over (or ``dropped``) ``lag`` versions behind the newest."""
        self.rollout_lags[lag] = self.rollout_lags.get(lag, 0) + 1
        if dropped:
            self.rollout_parts_dropped += 1
            self.rollout_steps_dropped += env_steps


__all__ = [
    "LATENCY_WINDOW",
    "NodeStats",
    "PoolStats",
    "StatsRecorder",
    "WorkerStats",
    "env_range",
    "node_layout",
]
