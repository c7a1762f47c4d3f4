"""Asynchronous, versioned rollouts measured as a training loop uses them (``bench/train.py``).

Each function takes an open pool and a policy and returns what it counted: :func:`overlap`
(a learner that sleeps while the workers collect), :func:`weight_bytes` (what a version of the
weights costs each node and each worker), :func:`collect` (``rollout_wait(min_envs)`` then those
envs restarted at once, every env-step started accounted for) and :func:`per_cpu` (env-steps per
CPU-second). :func:`figure_table` prints the :class:`Figure` rows, each ratio beside its target.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.table import Table

import envfleet
from envfleet.benchmark.base import busy_cpu_s
from envfleet.benchmark.cpu import pool_roles


class ArrayPolicy:
    """Linear over 4 features, 2 actions; its weights carry ``pad_bytes`` more bytes."""

    def __init__(self, pad_bytes: int = 0) -> None:
        self.w = np.eye(4, 2, dtype=np.float32)
        self.pad = np.zeros(pad_bytes, np.uint8)

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w, "pad": self.pad}

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        self.w, self.pad = weights["w"], weights["pad"]

    def __call__(self, observations: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        actions: np.ndarray = np.argmax(observations @ self.w, axis=1)
        return actions


def _mean_s(call: Callable[[], object], rounds: int) -> float:
    """Mean seconds of ``call`` over ``rounds``, after one call not timed."""
    call()
    start = time.perf_counter()
    for _ in range(rounds):
        call()
    return (time.perf_counter() - start) / rounds


def overlap(
    pool: envfleet.Pool, policy: Any, steps: int, learn_s: float, rounds: int
) -> dict[str, Any]:
    """A learner sleeping ``learn_s`` per update beside rollouts of ``steps``: seconds of a
    rollout alone (``collect``), of an update alone (``learn``), of an iteration of the
    synchronous loop (``rollout`` then learn) and of the asynchronous one (``rollout_wait``,
    the next version's ``rollout_async`` of those envs, then learn on what came back);
    ``started``/``handed``: the version started for each rollout and those handed over."""
    pool.reset(seed=0)
    collect = _mean_s(lambda: pool.rollout(policy, steps), rounds)
    learn = _mean_s(lambda: time.sleep(learn_s), rounds)

    def synchronous() -> None:
        pool.rollout(policy, steps)
        time.sleep(learn_s)  # the update

    sync = _mean_s(synchronous, rounds)
    started = [pool.rollout_async(policy, steps)]
    handed: list[list[int]] = []

    def iteration() -> None:
        r = pool.rollout_wait()
        handed.append(np.unique(r.policy_versions).tolist())
        started.append(pool.rollout_async(policy, steps, r.env_ids, version=started[-1] + 1))
        time.sleep(learn_s)  # the update, on r

    out = _mean_s(iteration, rounds)
    handed.append(np.unique(pool.rollout_wait().policy_versions).tolist())
    return {
        **{"collect_s": collect, "learn_s": learn, "sync_s": sync, "async_s": out},
        **{"started": started, "handed": handed},
    }


def weight_bytes(pool: envfleet.Pool, policy: Any, versions: int, steps: int = 2) -> dict[str, Any]:
    """What each new version of ``policy``'s weights costs (``versions`` of them, after one
    rollout that ships the code): the bytes the driver sent each node (node sub-pools), in units
    of the pickled weights, and the bytes each worker process read (its pipe: ``rchar`` of
    ``/proc/<pid>/io``; its envs read no file); then the bytes sent each node by a rollout of
    the same version again (no weights). ``workers``: each node's workers."""
    size = len(pickle.dumps(policy.weights(), protocol=pickle.HIGHEST_PROTOCOL))
    processes = [
        p for role, ps in pool_roles(pool).items() if role.startswith("worker") for p in ps
    ]
    pool.reset(seed=0)
    version = pool.rollout_async(policy, steps)
    pool.rollout_wait()

    def sent() -> np.ndarray:
        return np.array([n.bytes_out for n in sorted(pool.stats().nodes, key=lambda n: n.node)])

    def read() -> np.ndarray:
        return np.array([p.io_counters().read_chars for p in processes])

    workers = [n.workers for n in sorted(pool.stats().nodes, key=lambda n: n.node)]
    before, read_before = sent(), read()
    for _ in range(versions):
        version = pool.rollout_async(policy, steps, version=version + 1)
        pool.rollout_wait()
    after, read_after = sent(), read()
    pool.rollout_async(policy, steps, version=version)
    pool.rollout_wait()
    per_node = (after - before) / versions / size
    return {
        "weights_bytes": size,
        "workers": workers,
        "per_node_per_version": per_node.tolist(),
        "per_version": float(per_node.sum()),
        "same_version_bytes": (sent() - after).tolist(),
        "read_per_worker_per_version": ((read_after - read_before) / versions).tolist(),
    }


def collect(
    pool: envfleet.Pool,
    policy: Any,
    steps: int,
    seconds: float,
    min_envs: int | None,
    max_lag: int | None = None,
) -> dict[str, Any]:
    """For ``seconds``: ``rollout_wait(min_envs, max_lag=max_lag)`` and the envs handed over
    restarted at once with the next version (those of parts dropped too), then the parts still
    out drained. ``per_env``: env-steps handed over within the window (``seconds`` long);
    ``started`` = ``delivered`` (window and drain) + ``dropped`` (``stats()``). ``min_envs``
    ``None``: every env waited for, the synchronous loop (``pool.rollout`` is
    ``rollout_async`` + ``rollout_wait()``)."""
    pool.reset(seed=0)
    n, got = pool.num_envs, np.zeros(pool.num_envs, np.int64)
    dropped_at, started, drained = pool.stats().rollout_steps_dropped, 0, 0
    version = pool.rollout_async(policy, steps)
    started += steps * n
    start = end = time.perf_counter()
    while end - start < seconds:
        r = pool.rollout_wait(min_envs=min_envs, max_lag=max_lag)
        end = time.perf_counter()
        got[r.env_ids] += r.steps
        version += 1
        free = np.concatenate([r.env_ids, r.dropped_env_ids])  # dropped parts' envs too
        if len(free):
            pool.rollout_async(policy, steps, free, version=version)
            started += steps * len(free)
    while True:
        try:
            drained += pool.rollout_wait(max_lag=max_lag).rewards.size
        except envfleet.NoPendingError:
            break
    dropped = pool.stats().rollout_steps_dropped - dropped_at
    delivered = int(got.sum()) + drained
    return {
        **{"seconds": end - start, "per_env": got.tolist(), "started": started},
        **{"delivered": delivered, "dropped": dropped, "versions": version},
    }


def per_cpu(pool: envfleet.Pool, policy: Any, steps: int, rounds: int) -> dict[str, float]:
    """``rounds`` of the asynchronous loop over every env (``rollout_wait()``, then the next
    version's ``rollout_async``: its weights shipped each round), after one not timed:
    env-steps handed over, wall seconds, this process's CPU seconds and the whole machine's
    (every process: the workers, the agents, Ray's daemons, other users)."""
    pool.reset(seed=0)
    version = pool.rollout_async(policy, steps)
    done = 0
    for k in range(rounds + 1):
        if k == 1:
            wall, cpu, done = time.perf_counter(), time.process_time(), 0
            machine = busy_cpu_s()
        r = pool.rollout_wait()
        version = pool.rollout_async(policy, steps, r.env_ids, version=version + 1)
        done += r.rewards.size
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    machine = busy_cpu_s() - machine
    pool.rollout_wait()
    return {"env_steps": done, "wall_s": wall, "cpu_s": cpu, "machine_cpu_s": machine}


@dataclass(frozen=True)
class Figure:
    """One row of the table: ``value`` (in ``unit``) against ``base`` (what ``against``
    names); the target bounds the ratio ``value / base`` (``low``, ``high``; none: shown)."""

    name: str
    value: float
    unit: str
    against: str = ""
    base: float | None = None
    low: float | None = None
    high: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.value / self.base if self.base else None

    @property
    def met(self) -> bool | None:
        ratio = self.ratio
        if ratio is None or (self.low is None and self.high is None):
            return None
        return (self.low is None or ratio >= self.low) and (self.high is None or ratio <= self.high)

    def target(self) -> str:
        low, high = self.low, self.high
        if low is not None and high is not None:
            return f"{low:g}-{high:g}"
        return f">= {low:g}" if low is not None else "" if high is None else f"<= {high:g}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "target": self.target(), "met": self.met}


def figure_table(figures: list[Figure]) -> Table:
    """Every figure, its ratio against what it is judged by, and its target, met or missed."""
    table = Table("figure", "value", "against", "ratio", "target", "")
    for f in figures:
        mark = {None: "", True: "[green]met[/green]", False: "[red]missed[/red]"}[f.met]
        value = f"{f.value:,.3g} {f.unit}" if abs(f.value) < 1000 else f"{f.value:,.0f} {f.unit}"
        ratio = "" if f.ratio is None else f"{f.ratio:.3f}"
        table.add_row(f.name, value, f.against, ratio, f.target(), mark)
    return table


__all__ = [
    "ArrayPolicy",
    "Figure",
    "collect",
    "figure_table",
    "overlap",
    "per_cpu",
    "weight_bytes",
]
