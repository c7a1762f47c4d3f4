"""The founding question, answered in code: a slow simulator, stepped with Ray three ways.

``Simulator.step`` sleeps one second (a stand-in for a simulator that waits on something), and
each way takes four env steps:

1. one Ray actor holding one simulator, four remote calls: they run one after another, ~4 s;
2. two actors, two calls each: the actors run side by side, ~2 s;
3. envfleet, four envs on the ray backend (two actors stepping both of their envs at once,
   ``threads_per_worker=2``): one ``pool.step`` steps all four, ~1 s.

Usage::

    python examples/seed_simulator.py                     # the 1 s steps of the question
    python examples/seed_simulator.py --step-seconds 0.2  # or --fast: the same, quicker
    python examples/seed_simulator.py --address auto      # on a running Ray cluster
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import ray

import envfleet


@dataclass
class Args:
    step_seconds: float = 1.0
    """seconds each ``Simulator.step`` sleeps"""
    fast: bool = False
    """shorthand for ``--step-seconds 0.2``"""
    address: str | None = None
    """Ray to use ("auto", "ray://host:port"); default: the one running here, else a new one"""


def parse_args() -> Args:
    """``Args`` from the command line; each flag's help is its field's docstring."""
    docs: dict[str, str] = {}
    for node in ast.parse(Path(__file__).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            for field, doc in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(field, ast.AnnAssign)
                    and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                ):
                    docs[field.target.id] = str(doc.value.value)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        if field.default is False:
            parser.add_argument(flag, action="store_true", help=docs.get(field.name))
        else:
            kind = str if field.default is None else type(field.default)
            doc = docs[field.name]
            if field.default is not None and "default" not in doc:
                doc += f" (default: {field.default})"
            parser.add_argument(flag, type=kind, default=field.default, help=doc)
    return Args(**vars(parser.parse_args()))


class Simulator(gym.Env[np.ndarray, int]):
    """A simulator whose every step takes ``step_seconds`` of waiting."""

    def __init__(self, step_seconds: float = 1.0) -> None:
        self.observation_space = gym.spaces.Box(0, np.inf, shape=(1,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.step_seconds = step_seconds
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, dtype=np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.step_seconds)
        self.t += 1
        return np.array([self.t], dtype=np.float32), 1.0, False, False, {}


@ray.remote(num_cpus=0)  # it sleeps: it needs no CPU of its own
class SimulatorActor:
    """The plain pattern: one actor per simulator, one remote call per step."""

    def __init__(self, step_seconds: float) -> None:
        self.env = Simulator(step_seconds)
        self.env.reset(seed=0)

    def ready(self) -> bool:
        return True

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self.env.step(action)


if __name__ == "__main__":
    args = parse_args()
    step_seconds = 0.2 if args.fast else args.step_seconds
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False)

    # (1) One actor, four calls: an actor runs its calls one at a time.
    actor = SimulatorActor.remote(step_seconds)
    ray.get(actor.ready.remote())  # started before the clock starts
    start = time.perf_counter()
    ray.get([actor.step.remote(0) for _ in range(4)])
    one_actor = time.perf_counter() - start
    ray.kill(actor)

    # (2) Two actors, two calls each: the two actors run at the same time.
    actors = [SimulatorActor.remote(step_seconds) for _ in range(2)]
    ray.get([a.ready.remote() for a in actors])
    start = time.perf_counter()
    ray.get([a.step.remote(0) for a in actors for _ in range(2)])
    two_actors = time.perf_counter() - start
    for a in actors:
        ray.kill(a)

    # (3) envfleet: four envs in two actors; one remote call per actor steps both of its envs,
    # on two threads since they sleep, so one pool.step steps all four at once.
    with envfleet.make(
        Simulator,
        4,
        backend="ray",
        num_workers=2,
        threads_per_worker=2,
        env_kwargs={"step_seconds": step_seconds},
        address=args.address,
        seed=0,
    ) as pool:
        pool.reset()
        start = time.perf_counter()
        pool.step(np.zeros(4, dtype=np.int64))
        fleet = time.perf_counter() - start

    print(f"Simulator.step sleeps {step_seconds:g} s; each way takes 4 env steps")
    print(f"(1) one Ray actor, 4 calls:                {one_actor:.3f} s")
    print(f"(2) two Ray actors, 2 calls each:          {two_actors:.3f} s")
    print(f"(3) envfleet, 4 envs on backend='ray':     {fleet:.3f} s")
    if started_ray:
        ray.shutdown()
