"""The ray backend against plain Ray patterns and the process backend, side by side in one run.

Rows: ``naive-ray`` (an actor per env, a call per env step), ``batched-ray`` (the envs split by
hand over an actor per usable core, a call per actor per step: what the ray backend automates),
``envfleet-ray`` (its actors on this machine share the batch memory), ``envfleet-ray-calls``
(``ray_shared_memory=False``: a Ray call per command, as actors on other nodes) and
``envfleet-process``, on the workloads of :data:`RAY_TARGETS`. Ray's start-up is timed apart.

Usage (from the repository root, so that Ray's workers can import ``bench``)::

    python bench/ray_bench.py            # 3 windows of 3 s per runner: 2-3 minutes here
    python bench/ray_bench.py --quick    # 1 window of 0.5 s
    python -m bench.ray_bench --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import time
from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np

from bench import common, envs
from bench.common import Case
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import CallRunner, Runner, Timing, Workload, cycle, sample_actions
from envfleet.spec import EnvSpec


class BatchActor:
    """Several envs (or one: the naive pattern) per actor, stepped in one call."""

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


CASES = [
    Case("naive-ray", open_naive_ray),
    Case("batched-ray", open_batched_ray),
    Case("envfleet-ray", benchmark.envfleet_opener("ray", "envfleet-ray", ray_shared_memory=True)),
    Case(
        "envfleet-ray-calls",
        benchmark.envfleet_opener("ray", "envfleet-ray-calls", ray_shared_memory=False),
    ),
    Case("envfleet-process", benchmark.RUNNERS["process"].open),
]
RAY_TARGETS = {"cartpole": ("naive-ray", 5.0), "pong": ("envfleet-process", 0.8)}
"""Per workload: the baseline, and the least ratio of envfleet-ray to it that meets the target."""


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "ray.json")
    common.add_choice(parser, "--workloads", list(RAY_TARGETS))
    args = parser.parse_args(argv)
    timing = common.timing_from(args)
    import ray

    # Ray's warnings go to the log, not the screen.
    with common.script_run(args.json, ("ray", "ale-py")) as (console, output):
        if ray.is_initialized():
            raise SystemExit("run this with no Ray connected: it times Ray's start-up")
        start = time.perf_counter()
        # address="local": a Ray of its own, never a cluster someone else started here.
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        output["ray_startup_s"] = time.perf_counter() - start
        console.print(f"Ray start-up (ray.init of a local Ray): {output['ray_startup_s']:.2f} s")
        try:
            for name in args.workloads:
                case = envs.TARGETS[name]
                workload = Workload.of(case.env, case.num_envs)
                title = f"{workload.label} x {workload.num_envs} (env-steps/s)"
                baseline, minimum = RAY_TARGETS[name]
                report = common.measure_table(console, title, CASES, workload, timing, baseline)
                value = report.ratio("envfleet-ray", case.num_envs, baseline)
                check = common.target(console, f"envfleet-ray / {baseline}", value, minimum)
                output[name] = {**common.rows(report), "target": check}
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
