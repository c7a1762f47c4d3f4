"""Where should a batch that ``/dev/shm`` has no room for go: memfd, or a file in the temp dir?

``multiprocessing`` falls back to a file in the temp dir (on disk) when ``/dev/shm`` is full
(Docker's 64 MB); envfleet takes memfd memory instead (:mod:`envfleet.backends.shm`). This
script steps the same process pool (envs writing large image observations) with its batch in
each of the three, windows interleaved, and prints the median steps/s and the ratio to
``/dev/shm``.

    python bench/shm_fallback.py [--seconds 2] [--repeats 3] [--num-envs 16] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``envfleet`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import multiprocessing.heap
import statistics
import time
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

import envfleet
from envfleet.backends import process, shm

SIDE = 512
"""Observations are ``SIDE x SIDE`` uint8 images (256 KiB per env)."""


class ImageEnv(gymnasium.Env[np.ndarray, int]):
    """Each step returns a new image (the worker writes all of it into the batch)."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, shape=(SIDE, SIDE), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)
        self._frames = [np.full((SIDE, SIDE), k, dtype=np.uint8) for k in range(4)]
        self._t = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        return self._frames[0], {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        return self._frames[self._t % 4], 1.0, False, False, {}


@contextlib.contextmanager
def backing(name: str) -> Iterator[None]:
    """Put the next pool's batch in ``/dev/shm``, memfd, or a file of the temp dir."""
    original, candidates = process.batch_allocator, multiprocessing.heap.Arena._dir_candidates
    if name == "memfd":
        process.batch_allocator = lambda ctx, nbytes: shm.MemfdAllocator()  # type: ignore
    elif name == "temp-dir file":
        multiprocessing.heap.Arena._dir_candidates = []  # what a full /dev/shm leads to
    try:
        yield
    finally:
        process.batch_allocator = original
        multiprocessing.heap.Arena._dir_candidates = candidates


def window(name: str, num_envs: int, seconds: float) -> float:
    """Steps/s of a fresh pool over ``seconds``."""
    with backing(name):
        pool = envfleet.make(ImageEnv, num_envs, num_workers=2, context="fork", copy=False)
    with pool:
        pool.reset(seed=0)
        actions = np.zeros(num_envs, dtype=np.int64)
        for _ in range(10):
            pool.step(actions)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            pool.step(actions)
            steps += 1
        return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one 0.5 s window each")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats = 0.5, 1
    names = ("/dev/shm", "memfd", "temp-dir file")
    results: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            results[name].append(window(name, args.num_envs, args.seconds))
    mib = args.num_envs * SIDE * SIDE / 2**20
    print(f"{args.num_envs} envs, {mib:.0f} MiB of observations per step, 2 workers")
    base = statistics.median(results["/dev/shm"])
    for name in names:
        rate = statistics.median(results[name])
        print(f"{name:>14}: {rate:8.1f} steps/s  x{rate / base:.2f}")


if __name__ == "__main__":
    main()
