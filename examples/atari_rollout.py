"""Collect Atari frames with envfleet and save them as a NumPy ``.npz`` dataset.

    python examples/atari_rollout.py                       # 100k frames of ALE/Pong-v5, 16 envs,
                                                           # into runs/atari_rollout.npz
    python examples/atari_rollout.py --frames 2048 --out-dir runs/short

A "frame" here is one observation of one env (one ``step`` of one env; ALE v5 envs repeat each
action for 4 emulator frames). The policy is uniform random, seeded. Observations are grayscale
and, by default, averaged over 2x2 pixel blocks (210x160 -> 105x80) to keep the file small.

The ``.npz`` holds arrays indexed ``[step, env]``:

- ``observations`` (uint8): the observation each action was taken in;
- ``actions``, ``rewards``, ``terminations``, ``truncations``: what that step returned;
- ``episode_returns``, ``episode_lengths``: the episodes that ended during the rollout;

plus ``env_id``, ``num_envs`` and ``seed``. The pool resets an env in the step that ends its
episode (``SAME_STEP``), so every row is a real transition and the row after an episode's end
starts the next one. The last line printed is a JSON summary (``summary: {...}``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

import envfleet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--env-id", default="ALE/Pong-v5", help="the Atari game (default: ALE/Pong-v5)"
    )
    parser.add_argument(
        "--frames", type=int, default=100_000, help="observations in all (default: 100000)"
    )
    parser.add_argument("--num-envs", type=int, default=16, help="parallel envs (default: 16)")
    parser.add_argument(
        "--backend", default="process", help="process, thread or serial (default: process)"
    )
    parser.add_argument(
        "--num-workers", type=int, default=None, help="worker processes (default: usable cores)"
    )
    parser.add_argument("--seed", type=int, default=0, help="env i is seeded seed+i (default: 0)")
    parser.add_argument(
        "--downsample", type=int, default=2, help="pixel block size to average (default: 2)"
    )
    parser.add_argument(
        "--out-dir", default="runs", help="folder for the dataset, made if missing (default: runs)"
    )
    parser.add_argument("--out", help="the .npz file instead (default: OUT_DIR/atari_rollout.npz)")
    parser.add_argument("--no-compress", action="store_true", help="np.savez, not compressed")
    return parser.parse_args(argv)


def downsample(frames: np.ndarray, k: int) -> np.ndarray:
    """Average ``k x k`` pixel blocks of a batch of grayscale frames ``(n, H, W)``."""
    if k == 1:
        return frames
    n, height, width = frames.shape
    total = np.zeros((n, height // k, width // k), dtype=np.uint32)
    for dy in range(k):
        for dx in range(k):
            total += frames[:, dy : height - height % k : k, dx : width - width % k : k]
    return ((total + k * k // 2) // (k * k)).astype(np.uint8)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    steps = max(1, args.frames // args.num_envs)
    pool = envfleet.make(
        args.env_id,
        args.num_envs,
        backend=args.backend,
        num_workers=args.num_workers,
        seed=args.seed,
        env_kwargs={"obs_type": "grayscale"},
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(pool)
    try:
        obs, _ = envs.reset(seed=args.seed)
        first = downsample(obs, args.downsample)
        observations = np.empty((steps, args.num_envs, *first.shape[1:]), dtype=np.uint8)
        actions = np.empty((steps, args.num_envs), dtype=np.int64)
        rewards = np.empty((steps, args.num_envs), dtype=np.float32)
        terminations = np.empty((steps, args.num_envs), dtype=np.bool_)
        truncations = np.empty((steps, args.num_envs), dtype=np.bool_)
        episode_returns: list[float] = []
        episode_lengths: list[int] = []
        observations[0] = first
        started = time.perf_counter()
        for t in range(steps):
            action = envs.action_space.sample()
            obs, reward, terminated, truncated, infos = envs.step(action)
            actions[t], rewards[t] = action, reward
            terminations[t], truncations[t] = terminated, truncated
            if t + 1 < steps:
                observations[t + 1] = downsample(obs, args.downsample)
            if "episode" in infos:
                for i in np.flatnonzero(infos["_episode"]):
                    episode_returns.append(float(infos["episode"]["r"][i]))
                    episode_lengths.append(int(infos["episode"]["l"][i]))
            if (t + 1) % max(1, steps // 10) == 0 or t + 1 == steps:
                done = (t + 1) * args.num_envs
                rate = done / (time.perf_counter() - started)
                print(
                    f"frames={done}/{steps * args.num_envs} episodes={len(episode_returns)} "
                    f"fps={rate:.0f}",
                    flush=True,
                )
        seconds = time.perf_counter() - started
    finally:
        envs.close()

    out = Path(args.out) if args.out else Path(args.out_dir) / "atari_rollout.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    save = np.savez if args.no_compress else np.savez_compressed
    save(
        out,
        observations=observations,
        actions=actions,
        rewards=rewards,
        terminations=terminations,
        truncations=truncations,
        episode_returns=np.array(episode_returns, dtype=np.float32),
        episode_lengths=np.array(episode_lengths, dtype=np.int64),
        env_id=np.array(args.env_id),
        num_envs=np.array(args.num_envs),
        seed=np.array(args.seed),
    )
    summary = {
        "env_id": args.env_id,
        "frames": int(steps * args.num_envs),
        "num_envs": args.num_envs,
        "observation_shape": list(observations.shape[2:]),
        "episodes": len(episode_returns),
        "mean_episode_return": float(np.mean(episode_returns)) if episode_returns else None,
        "reward_sum": float(rewards.sum()),
        "fps": round(steps * args.num_envs / seconds),
        "out": str(out),
    }
    print("summary: " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
