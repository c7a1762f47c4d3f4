"""What the stepping loop adds per env: ``EnvGroup.step`` against the env's own ``step``.

In one process, no transport: ``n`` no-op envs (:class:`bench.envs.NoOpEnv`) stepped by a
plain loop and by an :class:`envfleet.group.EnvGroup` writing their rows into batch arrays, as a
worker does, in alternating short windows (the fastest of each taken); the difference divided
by ``n`` is the loop's own work per env.

Usage::

    python bench/group_cost.py                 # 32 and 64 envs, 500 windows of 20 calls each
    python bench/group_cost.py --quick         # 20 windows each
    python bench/group_cost.py --num-envs 8,64 --calls 50 --repeats 1000
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse

import numpy as np
from gymnasium.vector import AutoresetMode

from bench.common import int_list, timed
from bench.envs import NoOpEnv
from envfleet.buffers import Batch
from envfleet.group import EnvGroup
from envfleet.spec import EnvSpec

TARGET_US = 0.3  # the loop's own work per env, microseconds


def measure(n: int, calls: int, repeats: int) -> tuple[float, float]:
    """Least µs per env of the plain loop and of ``EnvGroup.step``, for ``n`` envs."""
    env = NoOpEnv()
    batch = Batch.local(env.observation_space, env.action_space, n)
    group = EnvGroup(
        EnvSpec(NoOpEnv),
        range(n),
        batch,
        AutoresetMode.NEXT_STEP,
        env.observation_space,
        env.action_space,
    )
    group.reset(list(range(n)), [0] * n, None)
    envs = [group.envs[i] for i in range(n)]
    ids = tuple(range(n))
    actions = batch.actions
    actions[:] = np.arange(n) % 2

    def plain() -> None:
        for i, e in enumerate(envs):
            e.step(actions[i])

    def grouped() -> None:
        group.step(ids)

    loops: list[float] = []
    groups: list[float] = []
    for _ in range(repeats):
        loops.append(timed(plain, calls)[0] / calls / n * 1e6)
        groups.append(timed(grouped, calls)[0] / calls / n * 1e6)
    group.close()
    return min(loops), min(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-envs", type=int_list, default=[32, 64])
    parser.add_argument("--calls", type=int, default=20, help="calls per timed window")
    parser.add_argument("--repeats", type=int, default=500, help="windows of each")
    parser.add_argument("--quick", action="store_true", help="20 windows each")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 20
    for n in args.num_envs:
        loop, grouped = measure(n, args.calls, args.repeats)
        extra = grouped - loop
        print(
            f"no-op x {n}: env.step {loop:.3f} µs/env, EnvGroup.step {grouped:.3f} µs/env; "
            f"the loop's own work {extra:.3f} µs/env (target <= {TARGET_US})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
