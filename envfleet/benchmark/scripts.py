"""What the ``bench/`` scripts share beyond their cases: the ideal row, ratio columns, targets,
the machine line, a choice of parts, and the async (``recv`` + ``send``) openers.

A script lists its workloads and :class:`~envfleet.benchmark.cases.Case` rows and calls these;
:mod:`envfleet.benchmark.cases` measures and tabulates them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import CallRunner, Runner, RunResult, Timing, Workload
from envfleet.benchmark.cases import (
    Case,
    Column,
    cycle,
    discrete_actions,
    fmt,
    measure_cases,
    median_of,
    ratio,
    results_table,
)
from envfleet.benchmark.measure import machine_info
from envfleet.benchmark.peers import puffer_env


def version(package: str) -> str | None:
    """The installed version of ``package``, or ``None``."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


class IdealRunner(CallRunner):
    """One env stepped alone, counted ``num_envs`` times: ``num_envs / mean step time``.

    Its info also gets the sync ideal: ``num_envs / mean of the slowest of num_envs`` steps
    (bootstrapped from the step times of the last window), and the mean step in ms.
    """

    def __init__(self, workload: Workload, timing: Timing) -> None:
        env = workload.spec.build()
        env.reset(seed=timing.seed)
        n = workload.num_envs
        self.durations: list[float] = []

        def advance() -> int:
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(0)
            self.durations.append(time.perf_counter() - start)
            if terminated or truncated:
                env.reset()
            return n

        super().__init__("ideal", advance, env.close, timing, num_envs=n)

    def window(self, seconds: float) -> float:
        self.durations.clear()
        rate = super().window(seconds)
        d = np.array(self.durations[-100_000:])
        if len(d) >= 10:
            n = self.info["num_envs"]
            rng = np.random.default_rng(0)
            slowest = d[rng.integers(0, len(d), size=(2000, n))].max(axis=1).mean()
            self.info["mean_step_ms"] = float(d.mean() * 1e3)
            self.info["ideal_sync_steps_per_s"] = float(n / slowest)
        return rate


def open_envfleet(
    workload: Workload, timing: Timing, *, batch_size: int | None = None, **make_kwargs: Any
) -> Runner:
    """``envfleet.make``: ``step`` when sync, else ``recv`` + ``send`` to ``infos["env_id"]``."""
    n = workload.num_envs
    pool = envfleet.make(workload.spec, n, batch_size=batch_size, seed=timing.seed, **make_kwargs)
    info = {"num_workers": pool.num_workers, "batch_size": pool.batch_size, **make_kwargs}
    try:
        return recv_send_runner("envfleet", pool, n, pool.batch_size, timing, **info)
    except BaseException:
        pool.close()
        raise


def open_envpool_by_batch(
    workload: Workload, timing: Timing, *, task: str, batch_size: int | None = None, **kw: Any
) -> Runner:
    """EnvPool's ``task`` (``env_type="gymnasium"``, one thread per usable core unless ``kw``
    says otherwise): ``step`` when sync, else ``recv`` + ``send``."""
    import envpool

    n = workload.num_envs
    batch = n if batch_size is None else batch_size
    kw.setdefault("num_threads", len(usable_cpus()))
    env = envpool.make(
        task, env_type="gymnasium", num_envs=n, batch_size=batch, seed=timing.seed, **kw
    )
    info = {"envpool": version("envpool"), "batch_size": batch, **kw}
    try:
        return recv_send_runner("envpool", env, n, batch, timing, seeded=False, **info)
    except BaseException:
        env.close()
        raise


PUFFER_SETTLE_S = 0.7
"""PufferLib's idle workers spin for 0.5 s before they start sleeping between polls."""


def open_pufferlib_by_batch(
    workload: Workload, timing: Timing, *, num_workers: int, batch_size: int | None = None
) -> Runner:
    """PufferLib's ``Multiprocessing`` backend (``recv`` + ``send``; sync when batch is all)."""
    with contextlib.redirect_stderr(io.StringIO()):  # the old ``gym`` it imports prints a notice
        import pufferlib.vector

    n = workload.num_envs
    batch = n if batch_size is None else batch_size
    vec = pufferlib.vector.make(
        functools.partial(puffer_env, workload.spec),
        backend=pufferlib.vector.Multiprocessing,
        num_envs=n,
        num_workers=num_workers,
        batch_size=batch,
        overwork=True,  # allowed: more workers than cores is the point of a comparison
    )
    pufferlib_version = version("pufferlib-core") or version("pufferlib")
    info: dict[str, Any] = {
        "pufferlib": pufferlib_version,
        "num_workers": num_workers,
        "batch_size": batch,
    }
    try:
        actions = discrete_actions(int(vec.single_action_space.n), batch, timing.seed)
        vec.async_reset(timing.seed)

        def recv_send(acts: np.ndarray) -> None:
            vec.recv()
            vec.send(acts)

        advance = cycle(recv_send, actions, batch)
        return CallRunner("pufferlib", advance, vec.close, timing, settle_s=PUFFER_SETTLE_S, **info)
    except BaseException:
        vec.close()
        raise


def recv_send_runner(
    name: str,
    vec: Any,
    num_envs: int,
    batch: int,
    timing: Timing,
    *,
    seeded: bool = True,
    **info: Any,
) -> Runner:
    """A :class:`CallRunner` over an EnvPool-style vector env ``vec`` (its ``action_space`` is
    ``Discrete``): ``step`` when ``batch`` is every env, else ``recv`` + ``send`` to the envs
    whose results came (``infos["env_id"]``). Resets ``vec`` (with ``timing.seed`` if
    ``seeded``, else as it was made); the caller closes it on failure."""
    space = getattr(vec, "single_action_space", None) or vec.action_space
    actions = discrete_actions(int(space.n), batch, timing.seed)
    seed = {"seed": timing.seed} if seeded else {}
    if batch == num_envs:
        vec.reset(**seed)
        return CallRunner(name, cycle(vec.step, actions, num_envs), vec.close, timing, **info)
    vec.async_reset(**seed)

    def recv_send(acts: np.ndarray) -> None:
        _, _, _, _, infos = vec.recv()
        vec.send(acts, infos["env_id"])

    return CallRunner(name, cycle(recv_send, actions, batch), vec.close, timing, **info)


def layouts(
    prefix: str, batches: Sequence[int], opener: Callable[..., Runner], *, forks: bool, **kw: Any
) -> list[Case]:
    """A sync row (``prefix sync``) and one async row per batch size (``prefix B=8``, opened
    with ``batch_size=8``, its :attr:`~Case.sync_of` the sync row), for one runner layout."""
    sync = f"{prefix} sync"
    cases = [Case(sync, functools.partial(opener, **kw), forks=forks)]
    for b in batches:
        opens = functools.partial(opener, batch_size=b, **kw)
        cases.append(Case(f"{prefix} B={b}", opens, forks=forks, sync_of=sync))
    return cases


def own_sync_column(cases: Sequence[Case], results: dict[str, RunResult | str]) -> Column:
    """``vs own sync``: an async row over its :attr:`~Case.sync_of` row (a sync row: 1.00)."""
    sync_of = {c.name: c.sync_of or c.name for c in cases}

    def cell(name: str, result: RunResult) -> str:
        if sync_of[name] == name:
            return "1.00" if name.endswith(" sync") else "-"
        return fmt(ratio(result.median, median_of(results, sync_of[name])))

    return "vs own sync", cell


def versus(header: str, base: float | None) -> Column:
    """A column of each row's median over ``base`` (``-`` when either is missing)."""
    return header, lambda _name, result: fmt(ratio(result.median, base))


def add_ratios(rows: dict[str, Any], key: str, base: float | None) -> None:
    """Add ``key``: steps/s over ``base`` to every measured row of a results table's JSON."""
    for row in rows.values():
        if "steps_per_s" in row:
            row[key] = ratio(row["steps_per_s"], base)


@dataclass(frozen=True)
class Versus:
    """A ratio column: each row's median over row ``row``'s, headed ``header`` and, if ``key``
    is given, added to each row's JSON under ``key``."""

    header: str
    row: str
    key: str | None = None


def measure_table(
    console: Console,
    title: str,
    cases: Sequence[Case],
    workload: Workload,
    timing: Timing,
    columns: Sequence[Versus] = (),
) -> tuple[dict[str, RunResult | str], dict[str, Any]]:
    """Measure ``cases`` on ``workload`` and print their table, titled ``title`` and the timing,
    with a ratio column per :class:`Versus`; the results and the table's JSON."""
    with console.status(f"{title}: measuring {len(cases)} runners ..."):
        results = measure_cases(cases, workload, timing, console)
    bases = [(column, median_of(results, column.row)) for column in columns]
    rows = results_table(
        console,
        f"{title} ({timing.repeats} x {timing.seconds:g} s, median)",
        [c.name for c in cases],
        results,
        [versus(column.header, base) for column, base in bases],
    )
    for column, base in bases:
        if column.key is not None:
            add_ratios(rows, column.key, base)
    return results, rows


def target(
    console: Console, label: str, value: float | None, minimum: float, *, end: str = "\n"
) -> dict[str, Any]:
    """Print ``label = value (target >= minimum) met/missed``; its JSON (``met`` is ``None``
    when ``value`` was not measured)."""
    met = None if value is None else value >= minimum
    mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
    console.print(f"[bold]{label} = {fmt(value)}[/bold] (target >= {minimum:g}){mark}{end}")
    return {"ratio": label, "value": value, "minimum": minimum, "met": met}


def ideal_info(results: dict[str, RunResult | str], name: str) -> dict[str, Any]:
    """The info of :class:`IdealRunner` row ``name`` (empty when it failed)."""
    result = results.get(name)
    return result.info if isinstance(result, RunResult) else {}


def print_machine(console: Console, packages: Sequence[str] = ()) -> dict[str, Any]:
    """Print a one-line summary of :func:`~envfleet.benchmark.machine_info`; return it."""
    machine = machine_info(packages)
    load = machine["load_average_at_start"]
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, Python "
        f"{machine['python']}, load average {f'{load[0]:.2f}' if load else '-'}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    return machine


def add_choice(parser: argparse.ArgumentParser, flag: str, choices: Sequence[str]) -> None:
    """A ``flag`` option taking a comma-separated subset of ``choices`` (default: all), as a
    list, checked."""

    def chosen(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or 'none'}: choose from {','.join(choices)}"
            )
        return names

    parser.add_argument(
        flag, type=chosen, default=list(choices), help=f"comma-separated, from {','.join(choices)}"
    )
