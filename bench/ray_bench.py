"""The ray backend against plain Ray patterns and the process backend, side by side in one run.

Runners (random actions, after warm-up; timed windows interleaved across runners so that a
change in the machine's load hits them all; the median window is reported):

- ``naive-ray``: one Ray actor per env, one remote call per env step (all in flight at once);
- ``batched-ray``: the envs split by hand over two actors (one per usable core), one remote call
  per actor steps all of its envs: what envfleet's ray backend automates;
- ``envfleet-ray``: ``envfleet.make(..., backend="ray")`` joining the Ray this script started
  (its actors are on this machine: they share the batch memory and take commands over a socket);
- ``envfleet-ray-calls``: the same with ``ray_shared_memory=False``: a Ray call per command, the
  path actors on other machines of a cluster take;
- ``envfleet-process``: ``envfleet.make(..., backend="process")``, the reference.

Workloads: CartPole-v1 x 64 and ALE/Pong-v5 x 8. Targets: envfleet-ray at least 0.8x
envfleet-process on Pong, and at least 5x naive-ray on CartPole. Ray's start-up (``ray.init``
of a local Ray) is timed apart from everything else. Prints a table per workload and writes
every number, with machine info, to ``bench/results/ray.json``.

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/ray_bench.py            # 3 windows of 3 s per runner: 2-3 minutes here
    python bench/ray_bench.py --quick    # 1 window of 1 s
    python -m bench.ray_bench --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import functools
import json
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import numpy as np
import ray
from rich.console import Console
from rich.table import Table

import envfleet
from bench.envs import WORKLOADS, Workload, build_env
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import LoopRunner, Runner, RunResult, Timing

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "ray.json"
BENCH_WORKLOADS = ("cartpole", "pong")


# -- the plain Ray patterns ----------------------------------------------------------------------


def _step_env(env: gymnasium.Env[Any, Any], action: Any) -> tuple[Any, float, bool, bool]:
    """One step, resetting an env whose episode ended (as the vector envs do)."""
    obs, reward, terminated, truncated, _ = env.step(action)
    if terminated or truncated:
        obs, _ = env.reset()
    return obs, float(reward), bool(terminated), bool(truncated)


class EnvActor:
    """The naive pattern: one env per actor, one remote call per step."""

    def __init__(self, env_id: str, seed: int) -> None:
        self.env = build_env(env_id)
        self.env.reset(seed=seed)

    def ready(self) -> bool:
        return True

    def step(self, action: Any) -> tuple[Any, float, bool, bool]:
        return _step_env(self.env, action)


class BatchActor:
    """The hand-batched pattern: several envs per actor, stepped in one call."""

    def __init__(self, env_id: str, seeds: Sequence[int]) -> None:
        self.envs = [build_env(env_id) for _ in seeds]
        for env, seed in zip(self.envs, seeds, strict=True):
            env.reset(seed=seed)

    def ready(self) -> bool:
        return True

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        results = [_step_env(env, a) for env, a in zip(self.envs, actions.tolist(), strict=True)]
        obs, rewards, terminated, truncated = zip(*results, strict=True)
        return np.stack(obs), np.array(rewards), np.array(terminated), np.array(truncated)


def _action_batches(workload: Workload, timing: Timing) -> list[np.ndarray]:
    env = build_env(str(workload.env))
    try:
        space = gymnasium.vector.utils.batch_space(env.action_space, workload.num_envs)
    finally:
        env.close()
    space.seed(timing.seed)
    return [space.sample() for _ in range(timing.action_batches)]


def _kill_all(actors: Sequence[Any]) -> None:
    for actor in actors:
        ray.kill(actor)


def open_naive_ray(workload: Workload, timing: Timing) -> Runner:
    """One actor per env; each step sends every env its action, then waits for them all."""
    start = time.perf_counter()
    cls = ray.remote(num_cpus=0)(EnvActor)
    actors = [cls.remote(str(workload.env), timing.seed + i) for i in range(workload.num_envs)]
    try:
        ray.get([actor.ready.remote() for actor in actors])
        setup_s = time.perf_counter() - start
        actions = [batch.tolist() for batch in _action_batches(workload, timing)]
    except BaseException:
        _kill_all(actors)
        raise

    def step(batch: list[Any]) -> None:
        ray.get([actor.step.remote(a) for actor, a in zip(actors, batch, strict=True)])

    return LoopRunner(
        "naive-ray",
        step,
        actions,
        workload.num_envs,
        timing,
        setup_s,
        lambda: _kill_all(actors),
        actors=len(actors),
    )


def open_batched_ray(workload: Workload, timing: Timing) -> Runner:
    """The envs split over one actor per usable core, each call stepping all of an actor's."""
    start = time.perf_counter()
    blocks = np.array_split(
        np.arange(workload.num_envs), min(len(usable_cpus()), workload.num_envs)
    )
    cls = ray.remote(num_cpus=0)(BatchActor)
    actors = [cls.remote(str(workload.env), (timing.seed + block).tolist()) for block in blocks]
    try:
        ray.get([actor.ready.remote() for actor in actors])
        setup_s = time.perf_counter() - start
        actions = _action_batches(workload, timing)
    except BaseException:
        _kill_all(actors)
        raise

    def step(batch: np.ndarray) -> None:
        ray.get([actor.step.remote(batch[b]) for actor, b in zip(actors, blocks, strict=True)])

    return LoopRunner(
        "batched-ray",
        step,
        actions,
        workload.num_envs,
        timing,
        setup_s,
        lambda: _kill_all(actors),
        actors=len(actors),
    )


def open_envfleet_ray(workload: Workload, timing: Timing, shared_memory: bool = True) -> Runner:
    """``envfleet.make(..., backend="ray")`` with its default worker count."""
    start = time.perf_counter()
    pool = envfleet.make(
        workload.env, workload.num_envs, backend="ray", ray_shared_memory=shared_memory
    )
    try:
        pool.reset(seed=timing.seed)
        setup_s = time.perf_counter() - start
        pool.action_space.seed(timing.seed)
        actions = [pool.action_space.sample() for _ in range(timing.action_batches)]
    except BaseException:
        pool.close()
        raise
    workers = min(len(usable_cpus()), workload.num_envs)
    return LoopRunner(
        "envfleet-ray" if shared_memory else "envfleet-ray-calls",
        pool.step,
        actions,
        pool.num_envs,
        timing,
        setup_s,
        pool.close,
        actors=workers,
    )


def open_envfleet_process(workload: Workload, timing: Timing) -> Runner:
    """``envfleet.make(..., backend="process")``: the engine of ``envfleet bench``'s runner."""
    spec = benchmark.Workload.of(workload.env, workload.num_envs)
    return benchmark.RUNNERS["process"].open(spec, timing)


RUNNERS: dict[str, Callable[[Workload, Timing], Runner]] = {
    "naive-ray": open_naive_ray,
    "batched-ray": open_batched_ray,
    "envfleet-ray": open_envfleet_ray,
    "envfleet-ray-calls": functools.partial(open_envfleet_ray, shared_memory=False),
    "envfleet-process": open_envfleet_process,
}
"""Every runner by name, in the order they are opened and shown."""

TARGETS = {
    "cartpole": ("envfleet-ray", "naive-ray", 5.0),
    "pong": ("envfleet-ray", "envfleet-process", 0.8),
}
"""Per workload: (runner, baseline, the least ratio of their throughputs that meets it)."""


# -- measuring -----------------------------------------------------------------------------------


def measure(workload: Workload, timing: Timing, console: Console) -> dict[str, RunResult | str]:
    """Open every runner, then time their windows in turns; a failed runner gets its error."""
    opened: dict[str, Runner] = {}
    results: dict[str, RunResult | str] = {}
    windows: dict[str, list[float]] = {name: [] for name in RUNNERS}

    def fail(name: str, exc: BaseException) -> None:
        results[name] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]{name} failed on {workload.name}:[/red] {results[name]}")
        traceback.print_exc()

    try:
        for name, open_runner in RUNNERS.items():
            console.print(f"  opening {name} ...")
            try:
                opened[name] = open_runner(workload, timing)
            except Exception as exc:
                fail(name, exc)
        for _ in range(timing.repeats):
            for name, runner in list(opened.items()):
                try:
                    windows[name].append(runner.window(timing.seconds))
                except Exception as exc:
                    fail(name, exc)
                    opened.pop(name).close()
    finally:
        for runner in opened.values():
            runner.close()
    for name, runner in opened.items():
        results[name] = RunResult(name, windows[name], runner.setup_s, runner.info)
    return {name: results[name] for name in RUNNERS if name in results}


def machine_info() -> dict[str, Any]:
    """:func:`envfleet.benchmark.machine_info`, with Ray and ale-py among the versions."""
    return benchmark.machine_info(("ray", "ale-py"))


def report(
    workload: Workload, results: dict[str, RunResult | str], console: Console
) -> dict[str, Any]:
    """Print the workload's table; return its JSON entry."""
    subject, baseline, minimum = TARGETS[workload.name]
    speeds = {n: r.median for n, r in results.items() if isinstance(r, RunResult)}
    ratio = speeds[subject] / speeds[baseline] if subject in speeds and baseline in speeds else None
    table = Table(title=f"{workload.label} x {workload.num_envs} (env-steps/s, median)")
    table.add_column("runner")
    table.add_column("steps/s", justify="right")
    table.add_column(f"vs {baseline}", justify="right")
    table.add_column("setup s", justify="right")
    table.add_column("actors/procs", justify="right")
    entry: dict[str, Any] = {"env": workload.label, "num_envs": workload.num_envs, "runners": {}}
    for name, result in results.items():
        if isinstance(result, str):
            table.add_row(name, f"[red]{result}[/red]", "-", "-", "-")
            entry["runners"][name] = {"error": result}
            continue
        base = speeds.get(baseline)
        count = next((result.info[k] for k in ("actors", "workers") if k in result.info), "-")
        table.add_row(
            name,
            f"{result.median:,.0f}",
            f"{result.median / base:.2f}x" if base else "-",
            f"{result.setup_s:.2f}",
            str(count),
        )
        entry["runners"][name] = {
            "steps_per_s": result.median,
            "windows": result.throughputs,
            "setup_s": result.setup_s,
            "info": result.info,
        }
    console.print(table)
    met = None if ratio is None else ratio >= minimum
    verdict = "-" if met is None else ("[green]met[/green]" if met else "[red]missed[/red]")
    shown = "-" if ratio is None else f"{ratio:.2f}"
    console.print(f"{subject} / {baseline}: {shown} (target >= {minimum:g}): {verdict}\n")
    entry["target"] = {
        "ratio": f"{subject} / {baseline}",
        "value": ratio,
        "minimum": minimum,
        "met": met,
    }
    return entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads",
        default=",".join(BENCH_WORKLOADS),
        help=f"comma-separated, from {','.join(BENCH_WORKLOADS)} (default: both)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="timed windows (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 window of 1 s")
    parser.add_argument(
        "--ray-system-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="ray.init(_system_config=...) of the local Ray, e.g. "
        '\'{"worker_niceness": 0, "max_direct_call_object_size": 4194304}\' (Ray runs its '
        "workers at nice 15 and sends results over 100 KB through its object store)",
    )
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in BENCH_WORKLOADS]
    if unknown or not args.workloads:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(BENCH_WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seconds, repeats, warmup = (1.0, 1, 0.2) if args.quick else (3.0, 3, 0.5)
    timing = Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=warmup,
        seed=args.seed,
    )
    console = Console()
    machine = machine_info()
    console.print(
        f"{machine['usable_cores']} usable cores ({machine['cpu_model']}), load average "
        f"{machine['load_average_at_start'][0]:.2f}; windows of {timing.seconds:g} s x "
        f"{timing.repeats}"
    )
    if ray.is_initialized():
        raise SystemExit("run this with no Ray connected: it times Ray's start-up")
    start = time.perf_counter()
    # address="local": a Ray of its own, never a cluster someone else started on this machine.
    tuning = {"_system_config": args.ray_system_config} if args.ray_system_config else {}
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **tuning)
    ray_startup_s = time.perf_counter() - start
    console.print(
        f"Ray start-up (ray.init of a local Ray): {ray_startup_s:.2f} s"
        + (f"; _system_config={args.ray_system_config}" if args.ray_system_config else "")
        + "\n"
    )
    entries: dict[str, Any] = {}
    try:
        for name in args.workloads:
            workload = WORKLOADS[name]
            console.print(f"[bold]{workload.label} x {workload.num_envs}[/bold]")
            entries[name] = report(workload, measure(workload, timing, console), console)
    finally:
        ray.shutdown()
    output = {
        "machine": machine,
        "timing": {
            "seconds": timing.seconds,
            "repeats": timing.repeats,
            "warmup": timing.warmup,
            "seed": timing.seed,
            "statistic": "median",
            "unit": "env-steps per second",
        },
        "ray_startup_s": ray_startup_s,
        "ray_system_config": args.ray_system_config or {},
        "workloads": entries,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(output, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
