"""What collecting ``Pool.stats()`` costs: the same pool stepped with statistics on and off.

CartPole-v1 x 64 on the process backend by default; windows alternate A B B A A B ... on one
pool. Three figures against a vector step with stats off: throughput (paired), the pool's CPU
in situ, and the recording calls alone (:mod:`envfleet.benchmark.stats_cost` explains them).
Target: under 2%.

    python bench/stats_overhead.py [--seconds 0.5] [--repeats 20] [--num-envs 64] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``envfleet`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse

from envfleet.benchmark.cases import save_json
from envfleet.benchmark.stats_cost import StatsSetup, stats_overhead

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "stats_overhead.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--backend", default="process")
    parser.add_argument("--num-workers", type=int, default=None, help="default: usable cores")
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 0.5)")
    parser.add_argument("--rewarm", type=float, default=0.2, help="untimed steps before each")
    parser.add_argument("--repeats", type=int, default=None, help="windows per side (default 20)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 windows of 0.2 s")
    args = parser.parse_args(argv)
    seconds, repeats = (0.2, 2) if args.quick else (0.5, 20)
    setup = StatsSetup(
        args.env,
        args.num_envs,
        args.backend,
        args.num_workers,
        seconds=seconds if args.seconds is None else args.seconds,
        rewarm=args.rewarm,
        repeats=repeats if args.repeats is None else args.repeats,
    )
    save_json(args.json, stats_overhead(setup))
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
