"""CPU per vector step of a pool hosting Atari VectorEnvs, by process, against the VectorEnv
alone: what hosting costs beyond the simulator.

ALE/Pong-v5 x 16 (``--num-envs``) two ways, each pool beside the VectorEnv it hosts stepped
alone in this process, in paired rounds that alternate which goes first
(:func:`envfleet.benchmark.cpu.paired`): ``ale`` hosts ale-vector's ``AtariVectorEnv`` (the
id's frames) a worker per usable core on one thread each (the ``ale-hosted`` runner), against
one ``AtariVectorEnv`` of every env on a thread per core (``ale-vector``); ``make_vec`` hosts
``gymnasium.make_vec``'s (84x84 grey frames, 4 stacked), a worker per core (the ``hosted``
runner), against ``make_vec``'s of every env alone (``vector``). Per role (the driver: this
process, every thread, so the VectorEnv alone's own threads too; each worker), CPU µs per
step; then all processes, wall time and the machine. A ratio near 1 means hosting costs little
CPU; CPU figures hold on a busy machine far better than wall time, which the scheduler shares
out by how many threads a layout runs.

Usage::

    python bench/hosted_cost.py                  # 9 rounds of 1 s each way, ~1 minute
    python bench/hosted_cost.py --layouts ale --rounds 15
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import itertools
from typing import Any

import gymnasium
import numpy as np
import psutil
from rich.console import Console

import envfleet
from bench import common
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import cpu
from envfleet.spec import EnvSpec

ENV = "ALE/Pong-v5"
LAYOUTS = ("ale", "make_vec")


def _pair(name: str, num_envs: int) -> tuple[Any, Any]:
    """The VectorEnv alone and the pool hosting the same, for layout ``name``."""
    if name == "ale":
        from ale_py.vector_env import AtariVectorEnv

        options = benchmark.ale_vector_options(EnvSpec.from_user(ENV))
        assert options is not None
        game, threads = options.pop("game"), len(usable_cpus())
        alone = AtariVectorEnv(game, num_envs, num_threads=threads, **options)
        fns = benchmark.ale_hosted_fns(EnvSpec.from_user(ENV), num_envs, threads)
        return alone, envfleet.make(vector_env_fns=fns, backend="process")
    alone = gymnasium.make_vec(ENV, num_envs, vectorization_mode="vector_entry_point")
    pool = envfleet.make(ENV, num_envs, backend="process", vectorization_mode="vector_entry_point")
    return alone, pool


def measure(console: Console, name: str, args: argparse.Namespace) -> dict[str, Any]:
    alone, pool = _pair(name, args.num_envs)
    try:
        space = alone.single_action_space
        space.seed(args.seed)
        actions = [
            np.array([space.sample() for _ in range(args.num_envs)], dtype=np.int64)
            for _ in range(64)
        ]
        alone.reset(seed=args.seed)
        pool.reset(seed=args.seed)
        mine, theirs = itertools.cycle(actions), itertools.cycle(actions)
        layouts = [
            cpu.Layout("hosted", lambda: pool.step(next(mine)), cpu.pool_roles(pool)),
            cpu.Layout(
                "alone", lambda: alone.step(next(theirs)), cpu.roles(psutil.Process(), [], [])
            ),
        ]
        got = cpu.paired(layouts, args.rounds, args.seconds)
    finally:
        pool.close()
        alone.close()
    compared = cpu.compare(got["hosted"], got["alone"])
    table = cpu.roles_table(f"{ENV} x {args.num_envs}, {name}: hosted (envfleet) / alone", compared)
    console.print(table)
    return compared


def main(argv: list[str] | None = None) -> int:
    parser = common.paired_parser(__doc__ or "", common.RESULTS / "hosted_cost.json", 9)
    common.add_choice(parser, "--layouts", list(LAYOUTS))
    parser.add_argument("--num-envs", type=int, default=16)
    args = common.paired_args(parser, argv)
    with common.script_run(args.json, ["ale-py"]) as (console, document):
        document.update(num_envs=args.num_envs, rounds=args.rounds, seconds=args.seconds)
        document["layouts"] = {name: measure(console, name, args) for name in args.layouts}
    return 0


if __name__ == "__main__":
    sys.exit(main())
