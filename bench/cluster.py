"""The ray backend's node sub-pools on a fake cluster (``ray.cluster_utils.Cluster``: a head and
4 worker nodes, all on this machine): the figures docs/cluster.md reads.

Rows (:func:`measure`: best of ``--repeats`` runs, per vector step: wall ms, the driver
process's CPU and its stepping thread's): the process backend on one machine; node pools of
no-op envs on 1, 2 and 4 nodes x 2 workers (the driver's CPU per node beyond the first) and 8
workers on 2 nodes; envs that sleep 10 ms a step on 1, 2 and 4 nodes; ``compress=`` on Pong
frames; RLlib's ``EnvRunnerGroup`` on the same nodes, in env-steps per driver CPU-second.
``--hosted``: CartPole's own VectorEnv hosted on 2 nodes, the driver's CPU per env-step as
its batch grows. ``--compress``, ``--rllib``, ``--hosted``: those rows alone; ``--quick``:
fewer steps. The no-op pool of 8 workers on 2 nodes against the bare node layout, every
process's CPU per step by role: ``bench/step_cost.py --workloads noop-64-nodes``.

    PYTHONPATH=. python bench/cluster.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

import envfleet
from bench import common
from bench.common import timed
from bench.envs import NoOpEnv

ONE_MACHINE: dict[str, Any] = {"backend": "process", "num_workers": 2}
"""The pool every cluster row is set against: the process backend on this machine."""
PAIR = {"pair": 1}
"""A custom resource of the first 2 worker nodes (RLlib's runners go there)."""
ROLLOUTS = (50, 200)
"""Rollout lengths measured, against RLlib's fragments of the same length."""


class PongReplay(NoOpEnv):
    """Replays recorded Pong frames, from a start its seed picks: the wire sees real frames
    while the nodes' CPUs are not spent emulating Atari."""

    def __init__(self, frames: np.ndarray) -> None:
        super().__init__(frames.shape[1:], frames.dtype)
        self.action_space = spaces.Discrete(6)
        self._frames, self._t = frames, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self._t = int(self.np_random.integers(len(self._frames)))
        return self._frames[self._t], {}

    def step(self, action: int) -> Any:
        self._t = (self._t + 1) % len(self._frames)
        return self._frames[self._t], 0.0, False, False, {}


class RLlibNoOp(NoOpEnv):
    """:class:`bench.envs.NoOpEnv` built as RLlib builds an env (from its ``env_config``)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__()


def pong_frames(count: int) -> np.ndarray:
    """``count`` frames of ALE Pong under random actions (after 100 steps: the game is on)."""
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make("ALE/Pong-v5")
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    frames = []
    for t in range(100 + count):
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(6)))
        if terminated or truncated:
            obs, _ = env.reset()
        if t >= 100:
            frames.append(obs)
    env.close()
    return np.stack(frames)


def measure(
    pool: envfleet.Pool, rounds: int, repeats: int, length: int = 0, policy: Any = None
) -> tuple[float, float, float]:
    """Best of ``repeats`` of ``rounds`` steps (or with ``length``, rollouts of that many steps
    by ``policy``), per vector step: wall ms, driver CPU ms (the whole process: Ray's own
    threads in it too) and the caller's thread CPU ms (the pool's own work)."""
    pool.reset(seed=0)
    actions = np.ones(pool.num_envs, dtype=np.int64)

    def call() -> object:
        return pool.rollout(policy, length) if length else pool.step(actions)

    for _ in range(1 if length else max(5, rounds // 10)):  # a rollout: the policy unpickled
        call()
    runs = [timed(call, rounds) for _ in range(repeats)]
    per_step = rounds * max(1, length)
    return min(tuple(t * 1e3 / per_step for t in run) for run in runs)  # type: ignore[return-value]


def row(name: str, envs: int, wall: float, cpu: float, own: float) -> dict[str, Any]:
    result = {"row": name, "envs": envs, "ms/step": wall, "driver CPU ms/step": cpu}
    result.update({"thread CPU ms/step": own, "env-steps/s": envs / wall * 1e3})
    print(
        f"{name:<44} envs={envs:<4} {wall:8.3f} ms/step  driver CPU {cpu:7.3f} ms/step "
        f"(its thread {own:7.3f})  {result['env-steps/s']:10.0f} env-steps/s",
        flush=True,
    )
    return result


def compress_rows(workers: list[str], steps: int, repeats: int) -> list[dict[str, Any]]:
    """compress= on Pong frames, 2 nodes: the pool's step and the wire bytes a frame."""
    frames, rows = pong_frames(64), []
    print(f"\nPong frames {frames.shape[1:]} uint8: {frames[0].nbytes} bytes each", flush=True)
    for compress in (None, "zlib", "lz4"):
        with envfleet.make(
            functools.partial(PongReplay, frames), 16, num_workers=4, nodes=workers[:2],
            backend="ray", seed=0, compress=compress,
        ) as pool:  # fmt: skip
            timing = measure(pool, steps, repeats)
            before = sum(n.bytes_in for n in pool.stats().nodes)
            for _ in range(10):
                pool.step(np.zeros(16, dtype=np.int64))
            received = sum(n.bytes_in for n in pool.stats().nodes) - before
            r = row(f"node pools, 2 nodes, Pong frames, compress={compress}", 16, *timing)
            r["wire bytes/frame"] = received / (10 * 16)  # rewards and flags included
            print(f"{'':44} {r['wire bytes/frame']:.0f} wire bytes/frame", flush=True)
            rows.append(r)
    return rows


@contextlib.contextmanager
def rllib_group(env: Any, envs: int, env_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """RLlib's ``EnvRunnerGroup`` (new API stack, PPO's defaults): 2 runners of ``envs`` envs
    each on the 2 "pair" nodes (:data:`PAIR`), ``env`` built from ``env_config``."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.env.env_runner_group import EnvRunnerGroup

    config = (
        PPOConfig()  # type: ignore[no-untyped-call]
        .environment(env=env, env_config=env_config or {})
        .env_runners(
            num_env_runners=2,
            num_envs_per_env_runner=envs,
            num_cpus_per_env_runner=0,
            custom_resources_per_env_runner=PAIR,
        )
    )
    group = EnvRunnerGroup(config=config, local_env_runner=False)
    try:
        yield group
    finally:
        group.stop()


def rllib_rows(workers: list[str], steps: int, repeats: int) -> list[dict[str, Any]]:
    """RLlib's EnvRunnerGroup (:func:`rllib_group`, 32 no-op envs a runner, random actions)
    against node pools (64 no-op envs, 2 nodes x 2 workers): env-steps per driver CPU-second,
    with fragments of 1 step (against ``pool.step``) and of :data:`ROLLOUTS` steps (against
    ``pool.rollout`` of as many, random actions drawn on the nodes), RLlib's runners returning
    the count of env-steps alone or the episodes themselves (what a learner needs)."""
    try:
        import ray.rllib  # noqa: F401
    except ImportError as exc:
        print(f"\nRLlib: not measured (ray.rllib does not import: {exc})", flush=True)
        return []
    rows, ours = [], {}
    with envfleet.make(NoOpEnv, 64, num_workers=4, nodes=workers[:2], backend="ray") as pool:
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=0)
        for length in (1, *ROLLOUTS):
            label = "pool.step" if length == 1 else f"rollout of {length} steps"
            count = steps if length == 1 else max(3, steps // length)
            timing = measure(pool, count, repeats, 0 if length == 1 else length, policy)
            r = row(f"node pools, 2 nodes x 2 workers, {label}", 64, *timing)
            r["env-steps per driver CPU-s"] = ours[length] = 64 / r["driver CPU ms/step"] * 1e3
            rows.append(r)
    with rllib_group(RLlibNoOp, 32) as group:
        for fragment, returned in [(1, False)] + [(f, r) for f in ROLLOUTS for r in (False, True)]:

            def sample(runner: Any, n: int = 32 * fragment, returned: bool = returned) -> Any:
                episodes = runner.sample(num_timesteps=n, random_actions=True)
                return episodes if returned else sum(len(e) for e in episodes)

            def once(done: list[int], sample: Any = sample, returned: bool = returned) -> None:
                for got in group.foreach_env_runner(sample, local_env_runner=False):
                    done[0] += sum(len(e) for e in got) if returned else int(got)

            once([0])  # warm up
            best = (float("inf"),) * 3 + (0,)
            for _ in range(repeats):
                done = [0]
                wall, cpu, own = timed(functools.partial(once, done), max(3, steps // fragment))
                best = min(best, (wall, cpu, own, done[0]), key=lambda b: b[1] / max(b[3], 1))
            wall, cpu, own, total = best
            scale = 64e3 / total  # ms per 64 env-steps: a vector step of the pool's rows
            label = f"RLlib EnvRunnerGroup, 2 runners, fragment {fragment}"
            label += (", episodes to driver" if returned else ", count to driver") * (fragment > 1)
            r = row(label, 64, wall * scale, cpu * scale, own * scale)
            theirs = r["env-steps per driver CPU-s"] = total / cpu if cpu else float("inf")
            print(
                f"{'':44} {theirs:,.0f} env-steps per driver CPU-second: node pools "
                f"{ours[fragment] / theirs:.2f}x, step by step {ours[1] / theirs:.2f}x",
                flush=True,
            )
            rows.append(r)
    return rows


def hosted_rows(workers: list[str], steps: int, repeats: int) -> list[dict[str, Any]]:
    """CartPole's own VectorEnv hosted by one worker on each of 2 nodes, against single envs on
    the same workers: the driver's CPU per env-step as the envs per hosted VectorEnv grow (one
    message per node per step whatever the batch)."""
    rows = []
    print("\nhosted VectorEnvs (CartPole-v1's vector entry point), 2 nodes x 1 worker")
    for envs in (16, 128, 1024):
        for mode in ("vector_entry_point", None):
            if mode is None and envs > 128:
                continue  # single envs: a Python step each, far from the hosted ones
            label = f"{'hosted' if mode else 'single envs'}, {envs // 2} per node"
            with envfleet.make(
                "CartPole-v1", envs, backend="ray", nodes=workers[:2], num_workers=2, seed=0,
                vectorization_mode=mode,
            ) as pool:  # fmt: skip
                r = row(label, envs, *measure(pool, steps, repeats))
            r["driver CPU us/env-step"] = r["driver CPU ms/step"] * 1e3 / envs
            print(f"{'':44} driver CPU {r['driver CPU us/env-step']:.2f} us/env-step", flush=True)
            rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a few seconds a row)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compress", action="store_true", help="the Pong compress= rows alone")
    parser.add_argument("--rllib", action="store_true", help="the RLlib comparison alone")
    parser.add_argument("--hosted", action="store_true", help="the hosted VectorEnv rows alone")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else 1000
    with common.fake_cluster(5, [{"pair": 100}] * 2) as cluster:  # 2 "pair" nodes
        workers = [n.node_id for n in cluster.worker_nodes]
        alone = args.compress or args.rllib or args.hosted
        if args.hosted or not alone:
            hosted_rows(workers, steps, args.repeats)
        if args.compress or not alone:
            compress_rows(workers, steps // 4, args.repeats)
        if args.rllib or not alone:
            rllib_rows(workers, steps, args.repeats)
        if alone:
            return 0
        noop, sleepy = NoOpEnv, functools.partial(NoOpEnv, sleep_s=0.01)

        def pools(n: int, w: int, **more: Any) -> dict[str, Any]:  # node pools on n nodes
            return {"backend": "ray", "nodes": workers[:n], "num_workers": w, **more}

        cases: list[tuple[str, Any, int, int, dict[str, Any]]] = [
            ("process, 1 machine, 2 workers", noop, 64, steps, ONE_MACHINE),
            *(
                (f"node pools, {n} node(s) x 2 workers", noop, 64, steps, pools(n, 2 * n))
                for n in (1, 2, 4)
            ),
            ("node pools, 8 workers on 2 nodes", noop, 64, steps, pools(2, 8)),
            *(
                (f"sleep 10 ms, {n} node(s) x 32 envs", sleepy, 32 * n, steps // 10, pools(n, n))
                for n in (1, 2, 4)
            ),
        ]
        rows = []
        print()
        for label, env, envs, count, make in cases:
            make = {**make, "threads_per_worker": 32} if env is sleepy else make
            with envfleet.make(env, envs, seed=0, **make) as pool:
                rows.append(row(label, envs, *measure(pool, max(20, count), args.repeats)))
        by = {r["row"]: r for r in rows}
        for n in (2, 4):
            r, one = (
                by[f"sleep 10 ms, {n} node(s) x 32 envs"],
                by["sleep 10 ms, 1 node(s) x 32 envs"],
            )
            print(f"sleep, {n} nodes: {r['env-steps/s'] / one['env-steps/s']:.2f}x one node")
        one, four = by["node pools, 1 node(s) x 2 workers"], by["node pools, 4 node(s) x 2 workers"]
        for key in ("driver CPU ms/step", "thread CPU ms/step"):
            extra = (four[key] - one[key]) / 3
            print(f"{key[:-8]} per extra node per step: {extra * 1e3:.0f} us (target <= 100)")
        eight, process = by["node pools, 8 workers on 2 nodes"], rows[0]
        print(
            f"8 workers on 2 nodes / process: {eight['env-steps/s'] / process['env-steps/s']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
