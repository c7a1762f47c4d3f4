"""Async pool: sync ``step`` against EnvPool-style ``send``/``recv`` side by side in one run.

Workloads (each a table; every runner's windows are interleaved with the others', so that load
from elsewhere on the machine hits them alike; the median window is reported):

- ``heavytail``: :class:`bench.async_envs.HeavyTailEnv` x 32 (per-env seeded: 90% of steps
  sleep 0.2 ms, 10% sleep 5 ms). envfleet thread backend (one thread per env), process backend
  with 4 workers, and 4 workers x 8 threads (``threads_per_worker``), each sync and async with
  ``batch_size`` 16 and 8; PufferLib's ``Multiprocessing`` (4 workers) alike. Target: async at
  least 1.5x the sync pool of the same layout. ``ideal`` rows step one env alone and scale it:
  ``32 / mean step time`` (what async could reach) and ``32 / mean of the slowest of 32``
  (what sync could reach).
- ``cartpole``: CartPole-v1 x 64; envfleet process (2 workers), EnvPool and PufferLib
  ``Multiprocessing`` (2 workers), sync and async (batch 32).
- ``pong``: Pong x 8; envfleet (``ALE/Pong-v5``, process with 2 workers and thread backend),
  EnvPool's ``Pong-v5`` (its own preprocessing: 84x84 grey, 4 frames stacked; and configured
  like ``ALE/Pong-v5``: 210x160 RGB, no stack, sticky actions 0.25) and PufferLib
  ``Multiprocessing`` over ``ALE/Pong-v5`` (2 workers); sync and async (batch 4).

A library that is not installed (or fails) shows as a failed row with the reason; the rest run.

Usage::

    python bench/async_bench.py                  # everything: 3 x 3 s windows, about 7 minutes
    python bench/async_bench.py --quick          # smoke run: 1 x 0.5 s window, about 1 minute
    python bench/async_bench.py --workloads heavytail --seconds 5 --repeats 5

The module also holds the small side-by-side harness that ``bench/thread_bench.py`` uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import functools
import importlib.metadata
import io
import itertools
import json
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

import envfleet
from bench.async_envs import HeavyTailEnv, expected_step_s, puffer_env
from bench.envs import build_env as build
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import OtherLoad

RESULTS = Path(__file__).resolve().parent / "results"
ASYNC_TARGET = 1.5

# -- the side-by-side harness --------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """How long and how often to measure.

    Attributes:
        seconds: length of each timed window.
        repeats: timed windows per runner (interleaved across runners); the median is reported.
        warmup: untimed stepping right after a runner is opened.
        rewarm: untimed stepping just before each of its windows.
        seed: seeds the envs and the pre-sampled actions.
    """

    seconds: float = 3.0
    repeats: int = 3
    warmup: float = 1.0
    rewarm: float = 0.2
    seed: int = 0


class Runner:
    """An opened runner: ``advance()`` makes one call and returns the env-steps it delivered.

    Args:
        name: row name.
        advance: one vector step (or one ``recv`` + ``send``).
        close: frees everything the runner holds.
        settle_s: idle seconds after each window (PufferLib's workers spin for 0.5 s after
            their last command: without a pause they would eat into the next runner's window).
        info: details for the JSON (layout, library version, ...).
    """

    def __init__(
        self,
        name: str,
        advance: Callable[[], int],
        close: Callable[[], object],
        *,
        settle_s: float = 0.0,
        **info: Any,
    ) -> None:
        self.name, self.advance, self._close = name, advance, close
        self.settle_s = settle_s
        self.info: dict[str, Any] = info
        self.setup_s = 0.0

    def window(self, seconds: float) -> float:
        """Step for ``seconds``; env-steps per second."""
        advance = self.advance
        steps = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            steps += advance()
            now = time.perf_counter()
            if now >= deadline:
                return steps / (now - start)

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class Case:
    """One row of a table.

    Attributes:
        name: row name.
        open: builds, resets and returns the runner.
        forks: the runner starts processes; such runners are opened before those that start
            threads in this process (forking a process full of threads is asking for trouble).
        sync_of: for an async row, the name of the sync row with the same layout.
    """

    name: str
    open: Callable[[Timing], Runner]
    forks: bool = False
    sync_of: str | None = None


@dataclass
class Result:
    """What one runner measured."""

    name: str
    windows: list[float]
    setup_s: float
    other_load: list[float]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.windows)


def measure(
    cases: Sequence[Case], timing: Timing, console: Console | None = None
) -> dict[str, Result | str]:
    """Open every case, then time their windows interleaved (the order rotates each round).

    Returns:
        For each case name, its :class:`Result` or, if it failed, ``"Type: message"``.
    """
    opened: dict[str, Runner] = {}
    failed: dict[str, str] = {}
    windows: dict[str, list[float]] = {c.name: [] for c in cases}
    loads: dict[str, list[float]] = {c.name: [] for c in cases}

    def fail(name: str, exc: BaseException) -> None:
        failed[name] = f"{type(exc).__name__}: {exc}".strip()
        if console is not None:
            console.print(f"[red]{name} failed[/red]: {failed[name][:300]}")
            if not isinstance(exc, ImportError | ModuleNotFoundError):
                text = "".join(traceback.format_exception(exc))
                console.print(text[-2000:], markup=False, highlight=False)

    try:
        for case in sorted(cases, key=lambda c: not c.forks):  # stable: forking ones first
            try:
                start = time.perf_counter()
                runner = case.open(timing)
                runner.setup_s = time.perf_counter() - start
            except Exception as exc:
                fail(case.name, exc)
                continue
            opened[case.name] = runner
            try:
                runner.window(timing.warmup)
                time.sleep(runner.settle_s)
            except Exception as exc:
                fail(case.name, exc)
                opened.pop(case.name).close()
        names = [c.name for c in cases if c.name in opened]
        for round_ in range(timing.repeats):
            k = round_ % max(1, len(names))
            for name in names[k:] + names[:k]:
                runner = opened.get(name)
                if runner is None:
                    continue
                try:
                    runner.window(timing.rewarm)
                    with OtherLoad() as load:
                        windows[name].append(runner.window(timing.seconds))
                    loads[name].append(load.cores)
                    time.sleep(runner.settle_s)
                except Exception as exc:
                    fail(name, exc)
                    opened.pop(name).close()
    finally:
        for name, runner in opened.items():
            try:
                runner.close()
            except Exception as exc:
                if console is not None:
                    console.print(f"[yellow]closing {name} failed: {exc}[/yellow]")
    results: dict[str, Result | str] = {}
    for case in cases:
        runner = opened.get(case.name)
        if case.name in failed or runner is None:
            results[case.name] = failed.get(case.name, "not run")
        else:
            results[case.name] = Result(
                case.name, windows[case.name], runner.setup_s, loads[case.name], runner.info
            )
    return results


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(packages: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`envfleet.benchmark.machine_info`, with ale-py and ``packages`` among the versions."""
    return benchmark.machine_info(("ale-py", *packages))


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(
    console: Console,
    title: str,
    cases: Sequence[Case],
    results: dict[str, Result | str],
    columns: Sequence[tuple[str, Callable[[str, Result], str]]],
) -> dict[str, Any]:
    """One row per case: steps/s, the given ratio columns, windows and other load."""
    table = Table(title=title, title_justify="left")
    table.add_column("runner", no_wrap=True)
    table.add_column("steps/s", justify="right")
    for header, _ in columns:
        table.add_column(header, justify="right")
    table.add_column("setup s", justify="right")
    table.add_column("windows", justify="right")
    table.add_column("other load", justify="right")
    out: dict[str, Any] = {}
    for case in cases:
        result = results[case.name]
        if isinstance(result, str):
            blanks = ["-"] * len(columns)
            table.add_row(case.name, "[red]failed[/red]", *blanks, "-", result[:70], "-")
            out[case.name] = {"error": result}
            continue
        table.add_row(
            case.name,
            f"{result.median:,.0f}",
            *(cell(case.name, result) for _, cell in columns),
            f"{result.setup_s:.1f}",
            " ".join(f"{w:,.0f}" for w in result.windows),
            " ".join(f"{c:.2f}" for c in result.other_load),
        )
        out[case.name] = {
            "steps_per_s": result.median,
            "windows": result.windows,
            "setup_s": result.setup_s,
            "other_load_cores": result.other_load,
            **result.info,
        }
    console.print(table)
    loads = [c for r in results.values() if isinstance(r, Result) for c in r.other_load]
    if loads and max(loads) > 0.2:
        console.print(
            f"[yellow]other processes kept up to {max(loads):.2f} cores busy during the windows "
            "('other load'): these numbers are skewed; compare ratios within a round[/yellow]"
        )
    return out


def median_of(results: dict[str, Result | str], name: str | None) -> float | None:
    result = results.get(name) if name is not None else None
    return result.median if isinstance(result, Result) else None


def write_json(path: Path, report: dict[str, Any], console: Console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"results written to {path}")


def base_parser(doc: str, default_json: Path) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="windows per runner (default 3)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up s (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=default_json, help="where to write results")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 window of 0.5 s per runner"
    )
    return parser


def timing_from(args: argparse.Namespace) -> Timing:
    seconds, repeats, warmup, rewarm = (0.5, 1, 0.3, 0.1) if args.quick else (3.0, 3, 1.0, 0.2)
    return Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=args.warmup if args.warmup is not None else warmup,
        rewarm=rewarm,
        seed=args.seed,
    )


# -- runners -------------------------------------------------------------------------------------


def discrete_actions(n: int, batch: int, seed: int, count: int = 64) -> list[np.ndarray]:
    """``count`` pre-sampled batches of ``batch`` actions of a ``Discrete(n)`` space."""
    rng = np.random.default_rng(seed)
    return list(rng.integers(0, n, size=(count, batch), dtype=np.int32))


def cycle(step: Callable[[Any], object], actions: Sequence[Any], envs_per_call: int) -> Any:
    """An ``advance`` that calls ``step`` with the actions in turn."""
    following = itertools.cycle(actions).__next__

    def advance() -> int:
        step(following())
        return envs_per_call

    return advance


def open_for_loop(env: Any, num_envs: int, timing: Timing, name: str = "for-loop") -> Runner:
    """A Python for-loop over the envs in this process, resetting those that finish."""
    envs = [build(env) for _ in range(num_envs)]
    for i, e in enumerate(envs):
        e.reset(seed=timing.seed + i)
    n = int(envs[0].action_space.n)
    actions = [a.tolist() for a in discrete_actions(n, num_envs, timing.seed)]

    def sweep(batch: list[int]) -> None:
        for e, action in zip(envs, batch, strict=True):
            _, _, terminated, truncated, _ = e.step(action)
            if terminated or truncated:
                e.reset()

    def close() -> None:
        for e in envs:
            e.close()

    return Runner(name, cycle(sweep, actions, num_envs), close)


def open_ideal(env: Any, num_envs: int, timing: Timing, name: str) -> Runner:
    """One env stepped alone, counted ``num_envs`` times: ``num_envs / mean step time``.

    Its info also gets the sync ideal: ``num_envs / mean of the slowest of num_envs`` steps
    (bootstrapped from the step times of the last window).
    """
    e = build(env)
    e.reset(seed=timing.seed)
    durations: list[float] = []
    runner: Runner

    def advance() -> int:
        start = time.perf_counter()
        _, _, terminated, truncated, _ = e.step(0)
        durations.append(time.perf_counter() - start)
        if terminated or truncated:
            e.reset()
        return num_envs

    def window(seconds: float) -> float:
        durations.clear()
        rate = Runner.window(runner, seconds)
        if len(durations) >= 10:
            d = np.array(durations)
            rng = np.random.default_rng(0)
            slowest = d[rng.integers(0, len(d), size=(2000, num_envs))].max(axis=1).mean()
            runner.info["mean_step_ms"] = float(d.mean() * 1e3)
            runner.info["ideal_sync_steps_per_s"] = float(num_envs / slowest)
        return rate

    runner = Runner(name, advance, e.close, num_envs=num_envs)
    runner.window = window  # type: ignore[method-assign]
    return runner


def open_envfleet(
    env: Any,
    num_envs: int,
    timing: Timing,
    *,
    name: str,
    batch_size: int | None = None,
    **make_kwargs: Any,
) -> Runner:
    """``envfleet.make``: ``step`` when sync, else ``recv`` + ``send`` to ``infos["env_id"]``."""
    pool = envfleet.make(env, num_envs, batch_size=batch_size, seed=timing.seed, **make_kwargs)
    info = {
        "num_workers": pool.num_workers,
        "batch_size": pool.batch_size,
        **{k: v for k, v in make_kwargs.items() if k != "env_kwargs"},
    }
    try:
        n = int(pool.single_action_space.n)
        if pool.batch_size == num_envs:
            pool.reset(seed=timing.seed)
            actions = discrete_actions(n, num_envs, timing.seed)
            return Runner(name, cycle(pool.step, actions, num_envs), pool.close, **info)
        batch = pool.batch_size
        actions = discrete_actions(n, batch, timing.seed)
        pool.async_reset(seed=timing.seed)

        def recv_send(acts: np.ndarray) -> None:
            _, _, _, _, infos = pool.recv()
            pool.send(acts, infos["env_id"])

        return Runner(name, cycle(recv_send, actions, batch), pool.close, **info)
    except BaseException:
        pool.close()
        raise


def open_envpool(
    task: str,
    num_envs: int,
    timing: Timing,
    *,
    name: str,
    batch_size: int | None = None,
    **kwargs: Any,
) -> Runner:
    """EnvPool (``env_type="gymnasium"``), one thread per usable core unless told otherwise."""
    import envpool

    batch = num_envs if batch_size is None else batch_size
    kwargs.setdefault("num_threads", len(usable_cpus()))
    env = envpool.make(
        task, env_type="gymnasium", num_envs=num_envs, batch_size=batch, seed=timing.seed,
        **kwargs,
    )  # fmt: skip
    info = {"envpool": version("envpool"), "batch_size": batch, **kwargs}
    try:
        n = int(env.action_space.n)
        actions = discrete_actions(n, batch, timing.seed)
        if batch == num_envs:
            env.reset()
            return Runner(name, cycle(env.step, actions, num_envs), env.close, **info)
        env.async_reset()

        def recv_send(acts: np.ndarray) -> None:
            _, _, _, _, infos = env.recv()
            env.send(acts, infos["env_id"])

        return Runner(name, cycle(recv_send, actions, batch), env.close, **info)
    except BaseException:
        env.close()
        raise


PUFFER_SETTLE_S = 0.7
"""PufferLib's idle workers spin for 0.5 s before they start sleeping between polls."""


def open_pufferlib(
    env: Any,
    num_envs: int,
    timing: Timing,
    *,
    name: str,
    num_workers: int,
    batch_size: int | None = None,
) -> Runner:
    """PufferLib's ``Multiprocessing`` backend (``recv`` + ``send``; sync when batch is all)."""
    with contextlib.redirect_stderr(io.StringIO()):  # the old ``gym`` it imports prints a notice
        import pufferlib.vector

    batch = num_envs if batch_size is None else batch_size
    vec = pufferlib.vector.make(
        functools.partial(puffer_env, env),
        backend=pufferlib.vector.Multiprocessing,
        num_envs=num_envs,
        num_workers=num_workers,
        batch_size=batch,
        overwork=True,  # allowed: 4 workers on 2 cores is the point of a comparison
    )
    info = {
        "pufferlib": version("pufferlib-core") or version("pufferlib"),
        "num_workers": num_workers,
        "batch_size": batch,
    }
    try:
        n = int(vec.single_action_space.n)
        actions = discrete_actions(n, batch, timing.seed)
        vec.async_reset(timing.seed)

        def recv_send(acts: np.ndarray) -> None:
            vec.recv()
            vec.send(acts)

        return Runner(
            name, cycle(recv_send, actions, batch), vec.close, settle_s=PUFFER_SETTLE_S, **info
        )
    except BaseException:
        vec.close()
        raise


# -- workloads -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    num_envs: int
    cases: Callable[[], list[Case]]
    reference: str
    """The envfleet sync row the ``vs ref`` column divides by."""


def _layouts(
    prefix: str,
    num_envs: int,
    batches: Sequence[int],
    opener: Callable[..., Runner],
    *,
    forks: bool,
    **kwargs: Any,
) -> list[Case]:
    """A sync row and one async row per batch size, for one runner layout."""
    sync = f"{prefix} sync"
    cases = [Case(sync, functools.partial(opener, name=sync, **kwargs), forks=forks)]
    for b in batches:
        name = f"{prefix} B={b}"
        cases.append(
            Case(
                name,
                functools.partial(opener, name=name, batch_size=b, **kwargs),
                forks=forks,
                sync_of=sync,
            )
        )
    return cases


def heavytail_cases() -> list[Case]:
    env, n, batches = HeavyTailEnv, 32, (16, 8)
    ef = functools.partial(open_envfleet, env, n)
    return [
        Case("ideal (32 x 1 env)", lambda t: open_ideal(env, n, t, "ideal (32 x 1 env)")),
        Case("for-loop", lambda t: open_for_loop(env, n, t)),
        *_layouts("envfleet thread", n, batches, ef, forks=False, backend="thread"),
        *_layouts(
            "envfleet process 4w", n, batches, ef, forks=True, backend="process", num_workers=4
        ),
        *_layouts(
            "envfleet process 4w x8t",
            n,
            batches,
            ef,
            forks=True,
            backend="process",
            num_workers=4,
            threads_per_worker=8,
        ),
        *_layouts(
            "envfleet process 8w x4t",
            n,
            batches,
            ef,
            forks=True,
            backend="process",
            num_workers=8,
            threads_per_worker=4,
        ),
        *_layouts(
            "pufferlib mp 4w",
            n,
            batches,
            functools.partial(open_pufferlib, env, n),
            forks=True,
            num_workers=4,
        ),
    ]


def cartpole_cases() -> list[Case]:
    n, batches = 64, (32,)
    return [
        *_layouts(
            "envfleet process 2w",
            n,
            batches,
            functools.partial(open_envfleet, "CartPole-v1", n),
            forks=True,
            backend="process",
            num_workers=2,
        ),
        *_layouts(
            "envpool", n, batches, functools.partial(open_envpool, "CartPole-v1", n), forks=False
        ),
        *_layouts(
            "pufferlib mp 2w",
            n,
            batches,
            functools.partial(open_pufferlib, "CartPole-v1", n),
            forks=True,
            num_workers=2,
        ),
    ]


ENVPOOL_PONG_AS_ALE = {
    "img_height": 210,
    "img_width": 160,
    "gray_scale": False,
    "stack_num": 1,
    "repeat_action_probability": 0.25,
    "noop_max": 1,
    "use_fire_reset": False,
}
"""EnvPool's Pong-v5 configured like Gymnasium's ALE/Pong-v5 (EnvPool still max-pools frames)."""


def pong_cases() -> list[Case]:
    n, batches = 8, (4,)
    ef = functools.partial(open_envfleet, "ALE/Pong-v5", n)
    ep = functools.partial(open_envpool, "Pong-v5", n)
    return [
        *_layouts(
            "envfleet process 2w", n, batches, ef, forks=True, backend="process", num_workers=2
        ),
        *_layouts("envfleet thread", n, batches, ef, forks=False, backend="thread"),
        *_layouts("envpool (84x84 grey x4)", n, batches, ep, forks=False),
        *_layouts("envpool (as ALE/Pong-v5)", n, batches, ep, forks=False, **ENVPOOL_PONG_AS_ALE),
        *_layouts(
            "pufferlib mp 2w",
            n,
            batches,
            functools.partial(open_pufferlib, "ALE/Pong-v5", n),
            forks=True,
            num_workers=2,
        ),
    ]


WORKLOADS: dict[str, Workload] = {
    "heavytail": Workload(
        "heavytail",
        "HeavyTailEnv x 32 (90% 0.2 ms, 10% 5 ms sleep)",
        32,
        heavytail_cases,
        "envfleet process 4w x8t sync",
    ),
    "cartpole": Workload(
        "cartpole", "CartPole-v1 x 64", 64, cartpole_cases, "envfleet process 2w sync"
    ),
    "pong": Workload(
        "pong",
        "Pong x 8 (envfleet/PufferLib: ALE/Pong-v5; EnvPool: its Pong-v5)",
        8,
        pong_cases,
        "envfleet process 2w sync",
    ),
}


def run_workload(workload: Workload, timing: Timing, console: Console) -> dict[str, Any]:
    cases = workload.cases()
    with console.status(f"{workload.name}: {len(cases)} runners ..."):
        results = measure(cases, timing, console)
    reference = median_of(results, workload.reference)
    sync_of = {c.name: c.sync_of or c.name for c in cases}

    def vs_sync(name: str, result: Result) -> str:
        if sync_of[name] == name:
            return "1.00" if name.endswith(" sync") else "-"
        return fmt(ratio(result.median, median_of(results, sync_of[name])))

    def vs_ref(name: str, result: Result) -> str:
        return fmt(ratio(result.median, reference))

    title = (
        f"{workload.title} ({timing.repeats} x {timing.seconds:g} s, median; "
        f"ref = {workload.reference})"
    )
    rows = print_table(
        console, title, cases, results, [("vs own sync", vs_sync), ("vs ref", vs_ref)]
    )
    verdicts = []
    for case in cases:
        if case.sync_of is None:
            continue
        value = ratio(median_of(results, case.name), median_of(results, case.sync_of))
        rows[case.name]["ratio_to_own_sync"] = value
        if case.name.startswith("envfleet") and workload.name == "heavytail":
            met = None if value is None else value >= ASYNC_TARGET
            verdicts.append({"runner": case.name, "async_over_sync": value, "meets_target": met})
            mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
            console.print(
                f"[bold]{case.name} / sync = {fmt(value)}[/bold] (target >= {ASYNC_TARGET}){mark}"
            )
    for row in rows.values():
        if "steps_per_s" in row:
            row["ratio_to_ref"] = ratio(row["steps_per_s"], reference)
    ideal = results.get("ideal (32 x 1 env)")
    if isinstance(ideal, Result) and "ideal_sync_steps_per_s" in ideal.info:
        console.print(
            f"ideal: async {ideal.median:,.0f} steps/s (32 / {ideal.info['mean_step_ms']:.3f} ms "
            f"measured mean step; requested {expected_step_s() * 1e3:.3f} ms), "
            f"sync {ideal.info['ideal_sync_steps_per_s']:,.0f} steps/s (32 / mean slowest of 32)"
        )
    console.print()
    return {
        "title": workload.title,
        "num_envs": workload.num_envs,
        "reference": workload.reference,
        "async_target": ASYNC_TARGET if workload.name == "heavytail" else None,
        "verdicts": verdicts,
        "runners": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__ or "", RESULTS / "async_bench.json")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    timing = timing_from(args)
    # EnvPool's spaces: "Box low's precision lowered by casting to float32".
    warnings.filterwarnings("ignore", message=".*precision lowered.*")
    console = Console(width=max(Console().width, 140))
    machine = machine_info(("envpool", "pufferlib-core", "pufferlib"))
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, Python "
        f"{machine['python']}, load average {machine['load_average_at_start'][0]:.2f}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    report: dict[str, Any] = {
        "machine": machine,
        "timing": {**timing.__dict__, "interleaved": True, "statistic": "median"},
        "unit": "env-steps per second (Pong: agent steps, 4 frames each)",
        "installs": install_notes(),
        "workloads": {},
    }
    for name in names:
        report["workloads"][name] = run_workload(WORKLOADS[name], timing, console)
    write_json(args.json, report, console)
    return 0


def install_notes() -> dict[str, str]:
    """What was found installing the libraries compared against (for the JSON)."""
    notes = {}
    notes["envpool"] = (
        f"installed {version('envpool')} (pip install envpool: manylinux wheel)"
        if version("envpool")
        else "not installed: pip install envpool"
    )
    puffer = version("pufferlib-core") or version("pufferlib")
    notes["pufferlib"] = (
        f"installed pufferlib-core {puffer} with --no-deps (it pins torch==2.9.0; torch "
        f"{version('torch')} was kept). pufferlib 3.0.0 itself does not install here: its sdist "
        "downloads raylib from GitHub while building, and only PyPI is reachable"
        if puffer
        else "does not install here: pufferlib 3.0.0 is an sdist whose build downloads raylib "
        "from GitHub (no network but PyPI); pufferlib-core pins torch==2.9.0 "
        "(install it with pip install --no-deps pufferlib-core)"
    )
    return notes


if __name__ == "__main__":
    sys.exit(main())
