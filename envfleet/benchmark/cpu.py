"""CPU per vector step of every process of a layout, by role, beside wall time.

A :class:`Layout` is a step and its processes by role: ``driver`` (the caller's process, every
thread), ``agent 0``, ..., ``worker 0``, ... and ``other`` (processes that serve no step: a
fork server). :func:`paired` times layouts in rounds, each round in another order, reading
every process's CPU time around each window: what the whole layout spends, which the caller's
thread alone misses and a machine's wake-ups hide in wall time. A ratio of two layouts is the
median of their per-round ratios (:func:`paired_ratio`): drift moves both sides of a round
alike. :func:`versus` sets an envfleet pool against another layout on the same actions (its
bare layout, :func:`bare_layout`, or the VectorEnv it hosts alone); :func:`roles_table` shows it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
from rich.table import Table

from envfleet.benchmark.bare import BarePool
from envfleet.benchmark.base import busy_cpu_s, cpu_seconds

Roles = dict[str, list[psutil.Process]]
"""A layout's processes by role."""


@dataclass(frozen=True)
class Layout:
    """A step to time and the processes that serve it, by role (:func:`versus` calls its
    other layout's step with a batch of actions, :func:`cpu_window` with none)."""

    name: str
    step: Callable[..., object]
    roles: Roles


@dataclass(frozen=True)
class CpuWindow:
    """One window of a layout, per vector step: wall µs, CPU µs of each role's processes, of
    the caller's thread alone (``thread_us``, inside ``driver``) and of the whole machine
    (``machine_us``: other users' work too, a check on the noise)."""

    wall_us: float
    roles_us: dict[str, float]
    thread_us: float
    machine_us: float

    @property
    def cpu_us(self) -> float:
        """CPU µs per step of every process of the layout."""
        return sum(self.roles_us.values())


def cpu_window(layout: Layout, seconds: float, warmup: int = 50) -> CpuWindow:
    """``layout.step`` called for ``seconds`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        layout.step()
    before = {role: cpu_seconds(ps) for role, ps in layout.roles.items()}
    machine, thread, start, steps = busy_cpu_s(), time.thread_time(), time.perf_counter(), 0
    deadline = start + seconds
    while True:
        layout.step()
        steps += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    thread, machine = time.thread_time() - thread, busy_cpu_s() - machine
    used = {role: cpu_seconds(ps) - before[role] for role, ps in layout.roles.items()}
    per = 1e6 / steps
    return CpuWindow(
        (now - start) * per, {r: s * per for r, s in used.items()}, thread * per, machine * per
    )


def paired(
    layouts: Sequence[Layout],
    rounds: int,
    seconds: float,
    progress: Callable[[str], object] | None = None,
) -> dict[str, list[CpuWindow]]:
    """Each layout's windows, one per round, round ``k`` starting with layout ``k``."""
    windows: dict[str, list[CpuWindow]] = {layout.name: [] for layout in layouts}
    for r in range(rounds):
        k = r % len(layouts)
        for layout in [*layouts[k:], *layouts[:k]]:
            if progress is not None:
                progress(f"{layout.name}, round {r + 1} of {rounds}")
            windows[layout.name].append(cpu_window(layout, seconds))
    return windows


def paired_ratio(
    mine: Sequence[CpuWindow], theirs: Sequence[CpuWindow], figure: Callable[[CpuWindow], float]
) -> float | None:
    """The median over rounds of ``figure(mine) / figure(theirs)`` (``None``: theirs is 0)."""
    pairs = [(figure(a), figure(b)) for a, b in zip(mine, theirs, strict=True)]
    if not pairs or any(b <= 0 for _, b in pairs):
        return None
    return statistics.median(a / b for a, b in pairs)


def roles(driver: psutil.Process, agents: Sequence[Any], workers: Sequence[Any]) -> Roles:
    """Roles of a layout from its processes (pids or ``psutil.Process``): ``other`` holds the
    workers' parents that are neither the driver nor an agent (fork servers)."""
    agents, workers = [_process(p) for p in agents], [_process(p) for p in workers]
    named: Roles = {"driver": [driver]}
    named.update({f"agent {i}": [p] for i, p in enumerate(agents)})
    named.update({f"worker {i}": [p] for i, p in enumerate(workers)})
    known = {p.pid for ps in named.values() for p in ps}
    other: dict[int, psutil.Process] = {}
    for worker in workers:
        parent = worker.parent()
        if parent is not None and parent.pid not in known:
            other[parent.pid] = parent
    named["other"] = list(other.values())
    return named


def _process(p: Any) -> psutil.Process:
    return p if isinstance(p, psutil.Process) else psutil.Process(p)


def pool_roles(pool: Any) -> Roles:
    """An envfleet pool's processes by role: the process backend's workers, or node sub-pools'
    agents (on this machine: a fake cluster) and their workers, each agent's in start order."""
    transport = pool._transport  # its processes are named by the transport alone
    if hasattr(transport, "pids"):  # the process backend
        return roles(psutil.Process(), [], [pid for pid in transport.pids() if pid])
    if not hasattr(transport, "_nodes"):
        kind = type(transport).__name__
        raise TypeError(f"{kind}: CPU by process reads process pools and node sub-pools only")
    agents = [psutil.Process(node.pid) for node in transport._nodes]
    workers = [
        worker
        for agent in agents
        for server in agent.children()
        if any("forkserver" in part for part in server.cmdline())
        for worker in sorted(server.children(), key=lambda p: p.create_time())
    ]
    if len(workers) != pool.num_workers:
        raise RuntimeError(f"found {len(workers)} workers of {pool.num_workers} on this machine")
    return roles(psutil.Process(), agents, workers)


def versus(
    pool: Any,
    other: Layout,
    actions: Sequence[Any],
    rounds: int,
    seconds: float,
    progress: Callable[[str], object] | None = None,
) -> dict[str, dict[str, Any]]:
    """``pool`` (reset) and ``other`` (a layout whose step takes a batch of actions: the bare
    layout's, a VectorEnv alone) stepped with ``actions`` in turn, in paired rounds: the figures
    of their windows side by side (:func:`compare`)."""
    mine, theirs = itertools.cycle(actions), itertools.cycle(actions)
    layouts = [
        Layout("envfleet", lambda: pool.step(next(mine)), pool_roles(pool)),
        Layout(other.name, lambda: other.step(next(theirs)), other.roles),
    ]
    got = paired(layouts, rounds, seconds, progress)
    return compare(got["envfleet"], got[other.name], other.name)


def bare_layout(bare: BarePool) -> Layout:
    """:class:`~envfleet.benchmark.bare.BarePool`'s step and its processes, for :func:`versus`."""
    return Layout("bare", bare.step, roles(psutil.Process(), **bare.pids))


def _role(name: str) -> Callable[[CpuWindow], float]:
    return lambda window: window.roles_us.get(name, 0.0)


def compare(
    mine: Sequence[CpuWindow], theirs: Sequence[CpuWindow], other: str = "bare"
) -> dict[str, dict[str, Any]]:
    """Per role (then ``all processes``, the caller's ``thread``, ``wall`` and ``machine``):
    the median µs per step of each side (``envfleet_us``, ``<other>_us``) and their paired
    ratio."""
    names = list(dict.fromkeys([*mine[0].roles_us, *theirs[0].roles_us]))
    figures: dict[str, Callable[[CpuWindow], float]] = {
        **{name: _role(name) for name in names},
        "all processes": lambda w: w.cpu_us,
        "thread": lambda w: w.thread_us,
        "wall": lambda w: w.wall_us,
        "machine": lambda w: w.machine_us,
    }
    return {
        name: {
            "envfleet_us": statistics.median(map(figure, mine)),
            f"{other}_us": statistics.median(map(figure, theirs)),
            "ratio": paired_ratio(mine, theirs, figure),
        }
        for name, figure in figures.items()
    }


def roles_table(title: str, compared: dict[str, dict[str, Any]]) -> Table:
    """:func:`compare`'s figures as a table, one row per role."""
    table = Table(title=title, title_justify="left")
    other = [key for key in next(iter(compared.values())) if key.endswith("_us")][1]
    for header in ("µs per step", "envfleet", other[:-3], f"envfleet / {other[:-3]}"):
        table.add_column(header, justify="left" if header == "µs per step" else "right")
    for name, row in compared.items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        label = {"thread": "(the caller's thread)", "machine": "(the whole machine)"}.get(name)
        table.add_row(label or name, f"{row['envfleet_us']:.1f}", f"{row[other]:.1f}", ratio)
    return table


__all__ = [
    "CpuWindow",
    "Layout",
    "bare_layout",
    "compare",
    "paired",
    "paired_ratio",
    "pool_roles",
    "roles",
    "roles_table",
    "versus",
]
