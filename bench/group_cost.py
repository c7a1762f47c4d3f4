"""What the stepping loop adds per env: ``EnvGroup.step`` against the env's own ``step``.

In one process, no transport: ``n`` no-op envs (:class:`bench.envs.NoOpEnv`, a constant
observation) stepped by a plain loop (``env.step(action)`` per env, the result dropped) and by an
:class:`envfleet.group.EnvGroup` writing their rows into batch arrays, as a worker does. Windows
of the two alternate (``--repeats``; the fastest of each is taken, the one least disturbed by
the rest of the machine); the difference divided by
``n`` is the loop's own work per env: reading the action, writing the observation, reward and
flags, the autoreset bookkeeping and the reply.

Usage::

    python bench/group_cost.py                 # 64 envs, 15 x 0.1 s windows each
    python bench/group_cost.py --quick         # 3 x 0.05 s windows each
    python bench/group_cost.py --num-envs 8,64 --seconds 0.2 --repeats 25
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import time
from collections.abc import Callable

import numpy as np
from gymnasium.vector import AutoresetMode

from bench.envs import NoOpEnv
from envfleet.buffers import Batch
from envfleet.group import EnvGroup
from envfleet.spec import EnvSpec

TARGET_US = 0.3  # the loop's own work per env, microseconds


def _time(call: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``call``, timed over a window of about ``seconds``."""
    calls, start = 0, time.perf_counter()
    end = start + seconds
    while True:
        for _ in range(100):
            call()
        calls += 100
        now = time.perf_counter()
        if now >= end:
            return (now - start) / calls


def measure(n: int, seconds: float, repeats: int) -> tuple[float, float]:
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
        loops.append(_time(plain, seconds) / n * 1e6)
        groups.append(_time(grouped, seconds) / n * 1e6)
    group.close()
    return min(loops), min(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-envs", type=lambda v: [int(n) for n in v.split(",")], default=[64])
    parser.add_argument("--seconds", type=float, default=0.1, help="timed window")
    parser.add_argument("--repeats", type=int, default=15, help="windows of each")
    parser.add_argument("--quick", action="store_true", help="3 windows of 0.05 s each")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats = 0.05, 3
    for n in args.num_envs:
        loop, grouped = measure(n, args.seconds, args.repeats)
        extra = grouped - loop
        print(
            f"no-op x {n}: env.step {loop:.3f} µs/env, EnvGroup.step {grouped:.3f} µs/env; "
            f"the loop's own work {extra:.3f} µs/env (target <= {TARGET_US})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
