"""How should the process backend wait: block in the kernel at once, or spin first?

Runs the same pools side by side in one process with ``SPIN_SECONDS`` (both the parent's wait
for replies and the workers' wait for commands) set to 0, 20 µs, 200 µs and 2 ms, and prints
steps/s with the ratio to blocking at once. Workers are forked, so they inherit the setting.

    python bench/waiting.py [--seconds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envfleet
from envfleet.backends import process

SPINS = (0.0, 20e-6, 200e-6, 2e-3)
WORKLOADS = (("CartPole-v1", 64, 2), ("ALE/Pong-v5", 8, 2))


def measure(env_id: str, num_envs: int, workers: int, spin: float, seconds: float) -> float:
    process.SPIN_SECONDS = spin
    try:
        with envfleet.make(env_id, num_envs, num_workers=workers, seed=0, context="fork") as pool:
            pool.reset()
            actions = [pool.action_space.sample() for _ in range(64)]
            for k in range(20):
                pool.step(actions[k % 64])
            steps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                pool.step(actions[steps % 64])
                steps += 1
            return steps * num_envs / (time.perf_counter() - start)
    finally:
        process.SPIN_SECONDS = 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/results/waiting.json"))
    args = parser.parse_args()
    results = {}
    for env_id, num_envs, workers in WORKLOADS:
        rates = {spin: [] for spin in SPINS}  # type: dict[float, list[float]]
        for _ in range(args.repeats):  # interleaved, so drift hits every setting alike
            for spin in SPINS:
                rates[spin].append(measure(env_id, num_envs, workers, spin, args.seconds))
        base = statistics.median(rates[0.0])
        print(f"\n{env_id}, {num_envs} envs, {workers} workers")
        print(f"{'spin':>10} {'steps/s':>10} {'ratio':>7}")
        for spin in SPINS:
            rate = statistics.median(rates[spin])
            print(f"{spin * 1e6:>8.0f}us {rate:>10.0f} {rate / base:>7.2f}")
        results[env_id] = {f"{spin:g}": statistics.median(r) for spin, r in rates.items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
