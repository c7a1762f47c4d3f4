"""The ray backend across nodes, side by side on a fake cluster (``ray.cluster_utils.Cluster``).

One run, one cluster (a head and 4 worker nodes, all on this machine), every row measured in
turn: the driver's CPU time per vector step (``time.process_time`` of the pool's process) and the
wall time, for one Ray actor per worker (``per-actor``: ``nodes=False``; ``1/node``: one Ray call
carries a node's batch), node pools (``nodes=[...]``: an agent per node, one message per node per
step; with the pool's own node in the layout too) and the process backend on one machine, against
nodes, workers, observation size and envs that sleep 10 ms a step; ``compress=`` on real Pong
frames (wire bytes, encode and decode cost of a frame, the pool's step); infos of plain
scalars (ALE's) from the nodes; and RLlib's
``EnvRunnerGroup`` on the same nodes, in env-steps per driver CPU-second (when ``ray.rllib``
imports). docs/cluster.md reads the figures. ``--quick``: fewer steps; ``--compress``: the Pong
rows alone; ``--infos``: Pong frames and no-op envs with and without ALE's infos, alone;
``--rllib``: the RLlib comparison alone; ``--bare``: the no-op target's pools beside the least
their layouts cost (the bare pool, the bare node pool), and the CPU of each process of the two
node layouts per step, alone.

    PYTHONPATH=. python bench/cluster.py --quick
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
import psutil
from gymnasium import spaces

import envfleet
from bench import common
from bench.common import timed
from bench.envs import NoOpEnv
from envfleet import benchmark

SHAPES = {
    "16 B": ((4,), np.float32),
    "84x84x4": ((84, 84, 4), np.uint8),
    "210x160x3": ((210, 160, 3), np.uint8),
}


def ale_info(t: int) -> dict[str, Any]:
    """ALE's infos at step ``t``: three plain scalars, as Pong gives them every step."""
    return {"lives": 0, "episode_frame_number": 4 * t, "frame_number": 4 * t}


class PongReplay(NoOpEnv):
    """Replays recorded Pong frames, from a start its seed picks: the wire sees real frames
    while the nodes' CPUs are not spent emulating Atari. ``infos``: ALE's, else none."""

    def __init__(self, frames: np.ndarray, infos: bool = False) -> None:
        super().__init__(frames.shape[1:], np.uint8)
        self.action_space = spaces.Discrete(6)
        self._frames, self._t, self._infos = frames, 0, infos

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self._t = int(self.np_random.integers(len(self._frames)))
        return self._frames[self._t], ale_info(self._t) if self._infos else {}

    def step(self, action: int) -> Any:
        self._t = (self._t + 1) % len(self._frames)
        return self._frames[self._t], 0.0, False, False, ale_info(self._t) if self._infos else {}


class AtariInfoNoOp(NoOpEnv):
    """:class:`bench.envs.NoOpEnv` with ALE's infos: three plain scalars every step."""

    _t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return self._obs, ale_info(self._t)

    def step(self, action: int) -> Any:
        self._t += 1
        return self._obs, 0.0, False, False, ale_info(self._t)


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


def codec_costs(frames: np.ndarray, block: int, repeats: int) -> dict[str, tuple[float, ...]]:
    """Per codec: bytes a frame, encode and decode microseconds a frame (best of ``repeats``),
    on blocks of ``block`` consecutive frames decoded straight into a batch array, and decoded
    into a new buffer then copied (the Python call's way, the fallback)."""
    from envfleet.backends.nodes.compression import codec

    out = {}
    target = np.zeros((2 * block, *frames.shape[1:]), np.uint8)
    blocks = [frames[k : k + block] for k in range(0, len(frames) - block + 1, block)]
    for name in ("zlib", "lz4"):
        squeeze = codec(name)
        assert squeeze is not None
        laps = []  # per repeat: encode, decode into the batch, decode then copy
        for _ in range(repeats):
            start = time.perf_counter()
            packed = [squeeze.compress(b.reshape(-1)) for b in blocks]
            encoded = time.perf_counter()
            for data in packed:
                squeeze.decompress_into(np.frombuffer(data, np.uint8), target[block:])
            decoded = time.perf_counter()
            for data in packed:
                raw = squeeze.decompress(np.frombuffer(data, np.uint8), target[block:].nbytes)
                target[block:] = np.frombuffer(raw, np.uint8).reshape(target[block:].shape)
            laps.append((encoded - start, decoded - encoded, time.perf_counter() - decoded))
        encode, decode, copied = (min(lap) for lap in zip(*laps, strict=True))
        assert (target[block:] == blocks[-1]).all()
        n = len(blocks) * block
        out[name] = (sum(map(len, packed)) / n, *(t * 1e6 / n for t in (encode, decode, copied)))
    return out


def compress_rows(workers: list[str], steps: int, repeats: int) -> list[dict[str, Any]]:
    """compress= on Pong frames: wire bytes and codec cost a frame, then the pool's step."""
    frames = pong_frames(64)
    raw = frames[0].nbytes
    print(f"\nPong frames {frames.shape[1:]} uint8: {raw} bytes each", flush=True)
    costs = codec_costs(frames, 8, repeats)
    for name, (size, encode, decode, copied) in costs.items():
        print(
            f"  {name:<5} {size:8.0f} bytes/frame ({raw / size:5.0f}x smaller)  "
            f"encode {encode:6.1f} us/frame  decode into the batch {decode:6.1f} us/frame "
            f"(into a new buffer, then copied: {copied:6.1f})",
            flush=True,
        )
    rows = []
    env = functools.partial(PongReplay, frames)
    for compress in (None, "zlib", "lz4"):
        with envfleet.make(
            env, 16, num_workers=4, nodes=workers[:2], backend="ray", seed=0, compress=compress
        ) as pool:
            timing = measure(pool, steps, repeats)
            before = sum(n.bytes_in for n in pool.stats().nodes)
            for _ in range(10):
                pool.step(np.zeros(16, dtype=np.int64))
            received = sum(n.bytes_in for n in pool.stats().nodes) - before
            label = f"node pools, 2 nodes, Pong frames, compress={compress}"
            r = row(label, 16, *timing)
            r["wire bytes/frame"] = received / (10 * 16)  # rewards and flags included
            print(f"{'':44} {r['wire bytes/frame']:.0f} wire bytes/frame", flush=True)
            rows.append(r)
    return rows


def info_rows(workers: list[str], head: str, steps: int, repeats: int) -> list[dict[str, Any]]:
    """Infos on the wire: Pong frames (16 envs) and no-op envs (64), with and without ALE's
    three scalar infos a step, 2 nodes x 2 workers; and the no-op envs with the pool's own node
    (``head``, its workers on the pool's memory) in the layout too, 3 nodes x 2 workers."""
    frames = pong_frames(64)
    two, three = {"nodes": workers[:2], "num_workers": 4}, {"nodes": [head, *workers[:2]]}
    cases = [
        ("2 nodes, Pong frames, no infos", functools.partial(PongReplay, frames), 16, two),
        ("2 nodes, Pong frames, ALE infos", functools.partial(PongReplay, frames, True), 16, two),
        ("2 nodes, no-op, no infos", NoOpEnv, 64, two),
        ("2 nodes, no-op, ALE infos", AtariInfoNoOp, 64, two),
        ("pool's node + 2, no-op, no infos", NoOpEnv, 64, {**three, "num_workers": 6}),
        ("pool's node + 2, no-op, ALE infos", AtariInfoNoOp, 64, {**three, "num_workers": 6}),
    ]
    rows = []
    print("\nInfos from node agents", flush=True)
    for label, env, envs, make in cases:
        count = steps // 4 if envs == 16 else steps
        with envfleet.make(env, envs, backend="ray", **make) as pool:
            rows.append(row(f"node pools, {label}", envs, *measure(pool, count, repeats)))
    return rows


def rllib_rows(workers: list[str], steps: int, repeats: int) -> list[dict[str, Any]]:
    """RLlib's EnvRunnerGroup (2 runners x 32 no-op envs on the 2 "pair" nodes, random actions)
    against node pools (64 no-op envs, 2 nodes x 2 workers): env-steps per driver CPU-second,
    with fragments of 1 step (the driver sees every step, as with ``pool.step``), 50 and 200
    (against ``pool.rollout`` of as many steps, random actions drawn on the nodes). RLlib's
    runners return either the count of env-steps alone (the driver receives an int per
    fragment) or the episodes themselves (what a learner needs, as ``pool.rollout`` returns
    every observation, action, reward and flag)."""
    try:
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.env.env_runner_group import EnvRunnerGroup
    except ImportError as exc:
        print(f"\nRLlib: not measured (ray.rllib does not import: {exc})", flush=True)
        return []
    rows = []
    ours: dict[int, float] = {}
    with envfleet.make(
        NoOpEnv, 64, num_workers=4, nodes=workers[:2], backend="ray", seed=0
    ) as pool:
        timing = measure(pool, steps, repeats)
        r = row("node pools, 2 nodes x 2 workers (RLlib's envs)", 64, *timing)
        r["env-steps per driver CPU-s"] = ours[1] = 64 / r["driver CPU ms/step"] * 1e3
        rows.append(r)
        print(f"{'':44} {ours[1]:,.0f} env-steps per driver CPU-second", flush=True)
        policy = envfleet.RandomPolicy(pool.single_action_space, seed=0)
        for length in ROLLOUTS:
            r = row(
                f"node pools, rollout of {length} steps",
                64,
                *measure(pool, max(3, steps // length), repeats, length, policy),
            )
            r["env-steps per driver CPU-s"] = ours[length] = 64 / r["driver CPU ms/step"] * 1e3
            rows.append(r)
            print(f"{'':44} {ours[length]:,.0f} env-steps per driver CPU-second", flush=True)
    config = (
        PPOConfig()
        .environment(env=RLlibNoOp)
        .env_runners(
            num_env_runners=2,
            num_envs_per_env_runner=32,
            num_cpus_per_env_runner=0,
            custom_resources_per_env_runner={"pair": 1},
        )
    )
    group = EnvRunnerGroup(config=config, local_env_runner=False)
    try:
        cases = [(1, False)] + [(f, returned) for f in ROLLOUTS for returned in (False, True)]
        for fragment, returned in cases:

            def count(runner: Any, n: int = 32 * fragment) -> int:  # the count alone comes back
                return sum(len(e) for e in runner.sample(num_timesteps=n, random_actions=True))

            def episodes(runner: Any, n: int = 32 * fragment) -> Any:  # the data comes back
                return runner.sample(num_timesteps=n, random_actions=True)

            def steps_in(result: Any, returned: bool = returned) -> int:
                return sum(len(e) for e in result) if returned else int(result)

            sample = episodes if returned else count
            rounds = max(3, steps // fragment)
            group.foreach_env_runner(sample, local_env_runner=False)  # warm up
            best = (float("inf"), float("inf"), float("inf"), 0)
            for _ in range(repeats):
                done = [0]

                def once(done: list[int] = done, sample: Any = sample) -> None:
                    results = group.foreach_env_runner(sample, local_env_runner=False)
                    done[0] += sum(steps_in(result) for result in results)

                wall, cpu, own = timed(once, rounds)
                best = min(best, (wall, cpu, own, done[0]), key=lambda b: b[1] / max(b[3], 1))
            wall, cpu, own, total = best
            scale = 64e3 / total  # ms per 64 env-steps: a vector step of the pool's rows
            label = f"RLlib EnvRunnerGroup, 2 runners, fragment {fragment}"
            if fragment > 1:
                label += ", episodes to driver" if returned else ", count to driver"
            r = row(label, 64, wall * scale, cpu * scale, own * scale)
            theirs = r["env-steps per driver CPU-s"] = total / cpu if cpu else float("inf")
            mine = "pool.step" if fragment == 1 else f"pool.rollout of {fragment}"
            print(
                f"{'':44} {theirs:,.0f} env-steps per driver CPU-second: node pools "
                f"({mine}) {ours[fragment] / theirs:.2f}x, step by step {ours[1] / theirs:.2f}x "
                "(target >= 2x)",
                flush=True,
            )
            rows.append(r)
    finally:
        group.stop()
    return rows


ROLLOUTS = (50, 200)
"""Rollout lengths measured, against RLlib's fragments of the same length."""


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


ONE_MACHINE: dict[str, Any] = {"backend": "process", "num_workers": 2}
"""The pool every cluster row is set against: the process backend on this machine."""
PAIR = {"pair": 1}
"""Where one actor per worker goes: the first 2 worker nodes (the custom resource "pair")."""


def eight_on_two(workers: list[str]) -> dict[str, Any]:
    """The no-op target's node pools: 8 workers on the first 2 worker nodes."""
    return {"backend": "ray", "nodes": workers[:2], "num_workers": 8}


def against_the_least(workers: list[str], seconds: float, repeats: int) -> dict[str, float]:
    """No-op x 64, 8 workers on 2 nodes (node pools) against the process backend on this machine,
    and each against the least its layout costs: the bare pool (2 workers passing a byte) and
    the bare node pool (2 agents over TCP, 4 workers each, passing a byte:
    :class:`envfleet.benchmark.bare.BareNodePool`). All four open at once and timed in
    interleaved windows by the benchmark engine, so the machine's drift between rows measured
    minutes apart moves no ratio (each is paired by round: :meth:`RunResult.over`). Returns the
    median µs per vector step of each, and the ratios under ``ratios``."""
    openers = {
        "process": benchmark.envfleet_opener(**ONE_MACHINE),
        benchmark.BARE_POOL: functools.partial(
            benchmark.open_bare_pool, num_workers=ONE_MACHINE["num_workers"]
        ),
        "node pools": benchmark.envfleet_opener(name="node pools", **eight_on_two(workers)),
        benchmark.BARE_NODES: functools.partial(
            benchmark.open_bare_nodes, nodes=2, workers_per_node=4
        ),
    }
    timing = benchmark.Timing.scaled(seconds, repeats)
    wakes = [benchmark.wake_round_trips()]  # what a wake-up costs now, before and after
    got = common.measured(openers, benchmark.Workload.of(NoOpEnv, 64), timing)
    wakes.append(benchmark.wake_round_trips())
    us = {name: 64e6 / result.median for name, result in got.items()}
    ratios = {
        "target": got["node pools"].over(got["process"]),
        "bare layouts": got[benchmark.BARE_NODES].over(got[benchmark.BARE_POOL]),
        "node pools over bare": got[benchmark.BARE_NODES].over(got["node pools"]),
        "process over bare": got[benchmark.BARE_POOL].over(got["process"]),
    }
    print(
        f"\nno-op x 64, 8 workers on 2 nodes, {repeats} interleaved windows of {seconds:g} s, "
        "median us per vector step: "
        + ", ".join(f"{name} {value:.0f}" for name, value in us.items())
        + "; ratios paired by round"
        + f"\n  node pools vs process backend: {ratios['target']:.3f}x (target >= 0.25x)"
        + f"\n  bare node pool vs bare pool: {ratios['bare layouts']:.3f}x (the layouts' own "
        "ratio on this machine, with nothing of envfleet's in it)"
        + f"\n  node pools / bare node pool: {ratios['node pools over bare']:.2f}, process / "
        f"bare pool: {ratios['process over bare']:.2f} (time per step: what envfleet adds to "
        "each layout)"
        + "\n  a wake-up's round trip, before and after: "
        + (benchmark.describe_wakes(*wakes) or "- (one core, or no pinning)")
        + " (a node layout's step waits for more wake-ups in a row than a one-node pool's)",
        flush=True,
    )
    return {**us, **{f"ratio {name}": value for name, value in ratios.items()}}


Processes = dict[str, list[psutil.Process]]
"""A layout's processes by role (``agents``, ``workers``)."""


def node_processes(pool: envfleet.Pool) -> Processes:
    """A node pool's agents (Ray actors named ``NodeAgent``; this pool's alone are alive) and
    their worker processes (children of each agent's fork server)."""
    agents = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any("NodeAgent" in part for part in p.info["cmdline"] or [])
    ]
    workers = [
        worker
        for agent in agents
        for server in agent.children()
        if any("forkserver" in part for part in server.cmdline())
        for worker in server.children()
    ]
    if len(agents) != len(pool.stats().nodes) or len(workers) != pool.num_workers:
        raise SystemExit(f"found {len(agents)} agents and {len(workers)} workers: not this pool's")
    return {"agents": agents, "workers": workers}


def cpu_window(
    step: Callable[[], object], processes: Processes, seconds: float
) -> tuple[float, float, dict[str, list[float]]]:
    """``step`` called for ``seconds`` (after 200 calls to warm up): µs per call of wall time,
    of the caller's thread CPU, and of each process's CPU by role (sorted)."""
    for _ in range(200):
        step()
    before = {role: [p.cpu_times() for p in ps] for role, ps in processes.items()}
    start, own, n = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    wall, own = time.perf_counter() - start, time.thread_time() - own
    used = {
        role: sorted(
            1e6 * (a.user + a.system - b.user - b.system) / n
            for a, b in zip((p.cpu_times() for p in ps), before[role], strict=True)
        )
        for role, ps in processes.items()
    }
    return 1e6 * wall / n, 1e6 * own / n, used


def cpu_by_process(workers: list[str], seconds: float, rounds: int = 2) -> None:
    """CPU per vector step of every process of the two node layouts of the no-op target (node
    pools; the bare node pool): the pool's thread, each agent, each worker, by ``psutil`` over
    ``seconds`` of steps, the two layouts in turn ``rounds`` times. Where the time of
    :func:`against_the_least`'s rows goes."""
    bare = benchmark.bare.BareNodePool(
        benchmark.Workload.of(NoOpEnv, 64), benchmark.Timing.scaled(1.0, 1), 2, 4
    )
    try:
        with envfleet.make(NoOpEnv, 64, seed=0, **eight_on_two(workers)) as pool:
            actions = np.ones(64, dtype=np.int64)
            pool.reset(seed=0)
            layouts: dict[str, tuple[Callable[[], object], Processes]] = {
                "node pools": (lambda: pool.step(actions), node_processes(pool)),
                "bare node pool": (
                    bare.step,
                    {role: [psutil.Process(p) for p in pids] for role, pids in bare.pids.items()},
                ),
            }
            print(f"\nCPU per vector step, each process (psutil, {seconds:g} s of steps):")
            for _ in range(rounds):
                for name, (step, processes) in layouts.items():
                    wall, own, used = cpu_window(step, processes, seconds)
                    print(
                        f"  {name:15} {wall:4.0f} us a step; the pool's thread {own:4.0f}, "
                        "agents "
                        + " ".join(f"{u:.0f}" for u in used["agents"])
                        + f", workers {used['workers'][0]:.0f}-{used['workers'][-1]:.0f} us",
                        flush=True,
                    )
    finally:
        bare.close()


def row(name: str, envs: int, wall: float, cpu: float, own: float) -> dict[str, Any]:
    result = {"row": name, "envs": envs, "ms/step": wall, "driver CPU ms/step": cpu}
    result.update({"thread CPU ms/step": own, "env-steps/s": envs / wall * 1e3})
    print(
        f"{name:<44} envs={envs:<4} {wall:8.3f} ms/step  driver CPU {cpu:7.3f} ms/step "
        f"(its thread {own:7.3f})  {result['env-steps/s']:10.0f} env-steps/s",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a few seconds a row)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compress", action="store_true", help="the Pong compress= rows alone")
    parser.add_argument("--rllib", action="store_true", help="the RLlib comparison alone")
    parser.add_argument(
        "--infos", action="store_true", help="the rows with and without ALE's infos alone"
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="no-op x 64 on 8 workers over 2 nodes against the process backend and the bare "
        "layouts alone",
    )
    args = parser.parse_args(argv)
    steps = 200 if args.quick else 1000
    with common.fake_cluster(5, [{"pair": 100}] * 2) as cluster:  # 2 "pair" nodes
        workers = [n.node_id for n in cluster.worker_nodes]
        if args.compress or args.rllib or args.infos or args.bare:
            if args.bare:
                against_the_least(workers, 0.5 if args.quick else 2.0, max(5, args.repeats))
                cpu_by_process(workers, 1.0 if args.quick else 4.0)
            if args.compress:
                compress_rows(workers, steps // 4, args.repeats)
            if args.infos:
                info_rows(workers, cluster.head_node.node_id, steps, args.repeats)
            if args.rllib:
                rllib_rows(workers, steps, args.repeats)
            return 0
        noop, sleepy = NoOpEnv, functools.partial(NoOpEnv, sleep_s=0.01)

        def pools(n: int, w: int, **more: Any) -> dict[str, Any]:  # node pools on n nodes
            return {"nodes": workers[:n], "num_workers": w, **more}

        def actors(w: int) -> dict[str, Any]:  # one actor per worker on the 2 "pair" nodes
            return {"nodes": False, "num_workers": w, "worker_resources": {"resources": PAIR}}

        cases: list[tuple[str, Any, int, int, dict[str, Any]]] = [
            ("process, 1 machine, 2 workers", noop, 64, steps, ONE_MACHINE),
            *(
                (f"node pools, {n} node(s) x 2 workers", noop, 64, steps, pools(n, 2 * n))
                for n in (1, 2, 4)
            ),
            ("per-actor, 1/node (Ray call per node)", noop, 64, steps, actors(2)),
            ("per-actor, 8 on 2 nodes", noop, 64, steps, actors(8)),
            ("node pools, 8 workers on 2 nodes", noop, 64, steps, pools(2, 8)),
        ]
        # The pool's own node (the head) in the layout: its workers on the pool's memory (the
        # default), or behind an agent like the other nodes' (ray_shared_memory=False).
        three = [cluster.head_node.node_id, *workers[:2]]
        for label, envs in (("16 B", 64), ("210x160x3", 24)):
            env = functools.partial(NoOpEnv, *SHAPES[label])
            for shared, where in ((True, "on its memory"), (False, "behind an agent")):
                make = {"nodes": three, "num_workers": 6, "ray_shared_memory": shared}
                name = f"node pools, pool's node {where} + 2 nodes, obs {label}"
                cases.append((name, env, envs, steps if envs == 64 else steps // 4, make))
        for label, (shape, dtype) in list(SHAPES.items())[1:]:
            env = functools.partial(NoOpEnv, shape, dtype)
            cases.append((f"node pools, 2 nodes, obs {label}", env, 16, steps // 4, pools(2, 4)))
            cases.append(
                (f"per-actor 1/node, 2 nodes, obs {label}", env, 16, steps // 4, actors(2))
            )
        for n in (1, 2, 4):
            make = pools(n, n, threads_per_worker=32)
            cases.append(
                (f"sleep 10 ms, {n} node(s) x 32 envs", sleepy, 32 * n, max(20, steps // 10), make)
            )
        rows: list[dict[str, Any]] = []
        for label, env, envs, count, make in cases:
            with envfleet.make(env, envs, seed=0, **{"backend": "ray", **make}) as pool:
                rows.append(row(label, envs, *measure(pool, count, args.repeats)))
        sleeps = [r for r in rows if r["row"].startswith("sleep")]
        for n, r in zip((1, 2, 4), sleeps, strict=True):  # N nodes against one
            r["vs one node"] = r["env-steps/s"] / sleeps[0]["env-steps/s"]
            print(f"{r['row']:<44} {r['vs one node']:.2f}x one node (target >= {0.8 * n:.1f}x)")
        one = next(r for r in rows if r["row"].startswith("node pools, 1 node"))
        four = next(r for r in rows if r["row"].startswith("node pools, 4 node"))
        for key in ("driver CPU ms/step", "thread CPU ms/step"):
            extra = (four[key] - one[key]) / 3
            print(f"\n{key[:-8]} per extra node per step: {extra * 1e3:.0f} us (target <= 100)")
        # Before the rows below: what they start (RLlib's runners) may still be going away.
        against_the_least(workers, 0.5 if args.quick else 2.0, max(5, args.repeats))
        rows += compress_rows(workers, steps // 4, args.repeats)
        rows += info_rows(workers, cluster.head_node.node_id, steps, args.repeats)
        rows += rllib_rows(workers, steps, args.repeats)
        process = rows[0]["env-steps/s"]
        eight = next(r for r in rows if r["row"] == "node pools, 8 workers on 2 nodes")
        print(
            "no-op x 64, 8 workers on 2 nodes vs process backend (rows above): "
            f"{eight['env-steps/s'] / process:.3f}x (target >= 0.25x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
