"""Fault tolerance soak: envs that raise, exit or hang at random; every step accounted for.

Two pools of :class:`envfleet.benchmark.soak_env.SoakEnv` side by side in one process, in
alternating chunks: one whose envs fail with probability ``--p-fail`` per step (raise an
exception, ``os._exit`` their worker, or hang until ``step_timeout`` kills it, chosen uniformly)
and a fault-free one, both with ``on_error="restart"``. Every result is checked as it comes
(:mod:`envfleet.benchmark.soak` lists the checks). It prints failures injected, restarts made
and steps/s against the fault-free pool (target: at least 0.9x). Exit status: 0 when every check
holds, 1 when one fails, 2 when a ``pool.step`` stalls for ``--stall-s``.

Usage::

    python bench/soak.py                      # 10^6 steps x 2 pools, p=1e-4: 30-40 s on 2 cores
    python bench/soak.py --quick              # 50k steps, p=1e-3 (so failures happen): ~10 s
    python bench/soak.py --steps 2000000 --workers 4 --step-timeout 0.5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``envfleet`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse

from envfleet.benchmark.soak import SoakConfig, run_soak
from envfleet.benchmark.soak_env import KINDS

RESULTS = Path(__file__).resolve().parent / "results"
SAME_NAMES = ("num_envs", "workers", "step_timeout", "hang_s", "episode_steps", "work_us")
SAME_NAMES += ("seed", "stall_s")
"""Options passed to :class:`SoakConfig` as they are."""


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, Path]:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=None, help="env steps per pool (1e6)")
    parser.add_argument("--p-fail", type=float, default=None, help="per step (1e-4)")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=0.25,
        help="seconds before a hung worker is killed (default 0.25; each hang costs this)",
    )
    parser.add_argument("--hang-s", type=float, default=60.0, help="how long a hang sleeps")
    parser.add_argument("--kinds", default=",".join(KINDS), help="failure kinds to inject")
    parser.add_argument("--episode-steps", type=int, default=1000)
    parser.add_argument(
        "--work-us", type=float, default=0.0, help="busy work per env step, microseconds"
    )
    parser.add_argument("--chunks", type=int, default=None, help="alternations (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    parser.add_argument(
        "--quick", action="store_true", help="50k steps with p=1e-3, so failures happen"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free pool")
    parser.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="a pool.step taking longer than this ends the run as stalled "
        "(default max(60, 40 x step_timeout))",
    )
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (a dying worker must not be the only one)")
    quick = args.quick
    config = SoakConfig(
        steps=args.steps or (50_000 if quick else 1_000_000),
        p_fail=args.p_fail if args.p_fail is not None else (1e-3 if quick else 1e-4),
        chunks=args.chunks or (4 if quick else 10),
        kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
        baseline=not args.no_baseline,
        **{k: getattr(args, k) for k in SAME_NAMES},
    )
    return config, args.json


def main(argv: list[str] | None = None) -> int:
    config, json_path = parse_args(argv)
    return run_soak(config, json_path)


if __name__ == "__main__":
    sys.exit(main())
