"""Throughput of envfleet against the baselines, side by side in one run (a thin caller of
:mod:`envfleet.benchmark`, which ``envfleet bench`` runs too).

A table per workload (:data:`bench.envs.TARGETS`: its runners, the row its ratios are to and a
target); every number, with machine info, in the JSON. ``ray-cartpole`` and ``ray-pong`` (not
run unless named) set the ray backend against plain Ray patterns (:data:`OWN`) on a Ray of this
run's own, whose start-up is timed apart. ``--runners`` takes the engine's names, this script's
and envfleet's variants (``process:batch_size=8``: :mod:`envfleet.benchmark.registry`).

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/throughput.py --workloads cartpole,pong      # about 5 minutes on 2 cores
    python bench/throughput.py --quick                        # smoke run: 1 window of 0.5 s
    python bench/throughput.py --workloads ray-cartpole,ray-pong --seconds 2 --repeats 3
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium
import numpy as np
from rich.console import Console

from bench import common
from bench.envs import TARGETS
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import CallRunner, Runner, Timing, Workload, cycle, sample_actions
from envfleet.spec import EnvSpec


class BatchActor:
    """Several envs (or one: the naive pattern) per Ray actor, stepped in one call."""

    def __init__(self, spec: EnvSpec, seeds: Sequence[int]) -> None:
        self.envs = [spec.build() for _ in seeds]
        for env, seed in zip(self.envs, seeds, strict=True):
            env.reset(seed=seed)

    def ready(self) -> bool:
        return True

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every env one step, each reset when its episode ends (as the vector envs do)."""
        results = [env.step(a) for env, a in zip(self.envs, actions.tolist(), strict=True)]
        obs = [
            o if not (t or u) else env.reset()[0]
            for env, (o, _, t, u, _) in zip(self.envs, results, strict=True)
        ]
        _, rewards, terminated, truncated, _ = zip(*results, strict=True)
        return np.stack(obs), np.array(rewards), np.array(terminated), np.array(truncated)


def _open_ray(name: str, workload: Workload, timing: Timing, num_actors: int) -> Runner:
    """The envs split over ``num_actors`` actors; a step is one call per actor, all in flight
    at once, each stepping its block of envs."""
    import ray

    blocks = np.array_split(np.arange(workload.num_envs), num_actors)
    cls: Any = ray.remote(num_cpus=0)(BatchActor)
    actors = [cls.remote(workload.spec, (timing.seed + block).tolist()) for block in blocks]

    def close() -> None:
        for actor in actors:
            ray.kill(actor)

    try:
        ray.get([actor.ready.remote() for actor in actors])
        env = workload.build()
        space = gymnasium.vector.utils.batch_space(env.action_space, workload.num_envs)
        env.close()
        actions = sample_actions(space, None, timing)
    except BaseException:
        close()
        raise

    def step(batch: np.ndarray) -> None:
        ray.get([actor.step.remote(batch[b]) for actor, b in zip(actors, blocks, strict=True)])

    advance = cycle(step, actions, workload.num_envs)
    return CallRunner(name, advance, close, timing, actors=len(actors))


def open_naive_ray(workload: Workload, timing: Timing) -> Runner:
    """One actor per env: a remote call per env step."""
    return _open_ray("naive-ray", workload, timing, workload.num_envs)


def open_batched_ray(workload: Workload, timing: Timing) -> Runner:
    """The envs split by hand over one actor per usable core: a call per actor per step."""
    return _open_ray("batched-ray", workload, timing, min(len(usable_cpus()), workload.num_envs))


_RAY_CALLS = benchmark.envfleet_opener("ray", "envfleet-ray-calls", ray_shared_memory=False)
OWN = {
    name: common.Case(name, opener)
    for name, opener in {
        "bare-threads": benchmark.open_bare_threads,
        "naive-ray": open_naive_ray,
        "batched-ray": open_batched_ray,
        "envfleet-ray": benchmark.envfleet_opener("ray", "envfleet-ray", ray_shared_memory=True),
        "envfleet-ray-calls": _RAY_CALLS,
    }.items()
}
"""Runners of this script's own, beside the engine's: ``naive-ray`` (an actor per env, a call
per env step), ``batched-ray`` (the envs split by hand over an actor per core: what the ray
backend automates), envfleet's ray backend with and without shared memory."""


def _runners(value: str) -> list[str]:
    """``--runners``: this script's own, or what the engine takes (aliases, variants)."""
    names: list[str] = []
    for raw in value.split(","):
        try:
            names += [raw.strip()] if raw.strip() in OWN else benchmark.parse_runners(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return list(dict.fromkeys(names))


@contextlib.contextmanager
def local_ray(console: Console, report: dict[str, Any]) -> Iterator[None]:
    """A Ray of this run's own (``address="local"``: never a cluster someone else started
    here), its start-up timed into ``report``."""
    import ray

    if ray.is_initialized():
        raise SystemExit("run this with no Ray connected: it times Ray's start-up")
    start = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    report["ray_startup_s"] = time.perf_counter() - start
    console.print(f"Ray start-up (ray.init of a local Ray): {report['ray_startup_s']:.2f} s")
    try:
        yield
    finally:
        ray.shutdown()


def run_workload(name: str, runners: list[str], timing: Any, console: Any) -> dict[str, Any]:
    target = TARGETS[name]
    n, reference = target.num_envs, target.reference
    workload = benchmark.Workload.of(target.env, n)
    cases = [OWN.get(runner, runner) for runner in runners]
    report = common.measure_table(console, name, cases, workload, timing, reference)
    check = None
    if target.target is not None:
        subject, least = target.target
        value = report.ratio(subject, n, reference)
        check = common.target(console, f"{name}: {subject} / {reference}", value, least)
    ratios = {r: report.ratio(r, n, reference) for r in runners}
    return {**common.rows(report), "reference": reference, "ratios": ratios, "target": check}


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "throughput.json")
    on_one = [name for name in TARGETS if not name.startswith("ray-")]
    common.add_choice(parser, "--workloads", list(TARGETS), default=on_one)
    parser.add_argument(
        "--runners",
        type=_runners,
        default=None,
        help=f"comma-separated, from {','.join([*benchmark.RUNNERS, *OWN])} and envfleet's "
        "variants (default: each workload's own)",
    )
    args = parser.parse_args(argv)
    timing = common.timing_from(args)
    ray = any(name.startswith("ray-") for name in args.workloads)
    # ale-py's banners and Ray's warnings go to the log.
    with common.script_run(args.json, ["ray"] if ray else []) as (console, report):
        report["timing"] = timing.as_dict()
        with local_ray(console, report) if ray else contextlib.nullcontext():
            report["workloads"] = {
                name: run_workload(
                    name, args.runners or list(TARGETS[name].runners), timing, console
                )
                for name in args.workloads
            }
    return 0


if __name__ == "__main__":
    sys.exit(main())
