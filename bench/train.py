"""Asynchronous, versioned rollouts in a training loop, side by side on a fake cluster (a head
and 2 worker nodes of ``ray.cluster_utils.Cluster``, all on this machine), every figure against
its target in one table (:mod:`envfleet.benchmark.training` measures; each part's function says
how):

(a) :func:`overlap`: the asynchronous loop against max(L, C) and L + C of a learner sleeping L
    beside envs collecting for C, and the synchronous loop;
(b) :func:`weights`: the bytes a version of the weights costs each worker and each node;
(c) :func:`stragglers`: ``rollout_wait(min_envs=..., max_lag=2)`` beside a straggling node;
(d) :func:`per_cpu`: env-steps per driver CPU-second (and per CPU-second of the whole machine)
    of an ``envfleet.TorchPolicy`` acting on the workers, against RLlib's ``EnvRunnerGroup``.

    PYTHONPATH=. python bench/train.py [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import envfleet
from bench import cluster, common
from bench.envs import NoOpEnv
from envfleet import benchmark
from envfleet.benchmark import training
from envfleet.benchmark.training import ArrayPolicy, Figure


def overlap(quick: bool, raw: dict[str, Any]) -> list[Figure]:
    """(a): L = C (the case overlap helps most), 2 envs on 2 workers, 10 steps a rollout."""
    learn = 0.05 if quick else 0.2
    env = {"sleep_s": learn / 10}
    with envfleet.make(NoOpEnv, 2, num_workers=2, env_kwargs=env, seed=0) as pool:
        got = raw["overlap"] = training.overlap(pool, ArrayPolicy(), 10, learn, 3 if quick else 10)
    most, both = max(got["learn_s"], got["collect_s"]), got["learn_s"] + got["collect_s"]
    name = f"max(L={got['learn_s']:.3f}, C={got['collect_s']:.3f})"
    return [
        Figure("(a) async loop: an iteration", got["async_s"], "s", name, most, high=1.1),
        Figure("(a) async loop: an iteration", got["async_s"], "s", "L + C", both),
        Figure("(a) sync loop: an iteration", got["sync_s"], "s", "L + C", both),
    ]


def weights(nodes: list[str], quick: bool, raw: dict[str, Any]) -> list[Figure]:
    """(b): one env per worker, 3 versions (1 with --quick) of 4 MB of weights: the bytes each
    worker reads per version on the process backend (4 workers: the weights reach them through
    shared memory), and the bytes the driver sends per version to 2 nodes x 2 and x 4 workers."""
    figures, process = [], {"backend": "process", "num_workers": 4}
    layouts = {"process backend, 4 workers": process}
    for k in (2, 4):
        ray = {"backend": "ray", "nodes": nodes, "num_workers": k * len(nodes)}
        layouts[f"2 nodes x {k} workers"] = ray
    for label, make in layouts.items():
        with envfleet.make(NoOpEnv, make["num_workers"], seed=0, **make) as pool:
            got = training.weight_bytes(pool, ArrayPolicy(4 << 20), 1 if quick else 3)
        raw[f"weights, {label}"], size = got, got["weights_bytes"]
        weights = f"weights ({size:,} B)"
        if make is process:
            most = max(got["read_per_worker_per_version"])
            name = f"(b) bytes a worker reads per version, {label}"
            figures.append(Figure(name, most, "B", weights, size, high=0.001))
        else:
            name = f"(b) bytes sent per version, {label}"
            sent = got["per_version"] * size
            figures.append(Figure(name, sent, "B", f"nodes x {weights}", 2 * size, 0.98, 1.02))
    return figures


def stragglers(nodes: list[str], quick: bool, raw: dict[str, Any]) -> list[Figure]:
    """(c): 8 envs, 2 nodes x 2 workers, 10 steps a rollout of 10 ms each (5 with --quick);
    both pools open, their windows interleaved (3 of 2 s; 1 of 1.5 s with --quick)."""
    (sleep, seconds), policy = (0.005, 1.5) if quick else (0.01, 2.0), ArrayPolicy()
    make: dict[str, Any] = {"backend": "ray", "nodes": nodes, "num_workers": 4, "seed": 0}
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        pools = {}
        for name, slow in (("straggler", 3), ("healthy", 1)):
            env = [{"sleep_s": sleep}] * 4 + [{"sleep_s": slow * sleep}] * 4
            pool = pools[name] = stack.enter_context(
                envfleet.make(NoOpEnv, 8, env_kwargs=env, **make)
            )
            if sorted(n.env_ids for n in pool.stats().nodes) != [(0, 1, 2, 3), (4, 5, 6, 7)]:
                raise SystemExit(f"not a node's envs each: {pool.stats().nodes}")
        cases = (
            ("straggler", "straggler", 4),
            ("sync", "straggler", None),
            ("healthy", "healthy", 4),
        )
        for _ in range(1 if quick else 3):
            for run, name, min_envs in cases:
                got = training.collect(pools[name], policy, 10, seconds, min_envs, max_lag=2)
                total = runs.setdefault(run, dict.fromkeys(got, 0))
                for key, value in got.items():
                    total[key] = np.add(total[key], value).tolist()
    raw["stragglers"] = runs

    def rate(run: str, envs: slice) -> float:
        return float(sum(runs[run]["per_env"][envs]) / runs[run]["seconds"])

    fast, both, unit = slice(0, 4), slice(0, 8), "env-steps/s"
    count = {k: sum(r[k] for r in runs.values()) for k in ("started", "delivered", "dropped")}
    mixed, steps = rate("straggler", both), count["delivered"] + count["dropped"]
    ours, healthy = rate("straggler", fast), rate("healthy", fast)
    dropped = f"started, all runs ({count['dropped']:,} dropped)"
    return [
        Figure("(c) fast node beside a straggler", ours, unit, "fast node, healthy", healthy, 0.9),
        Figure("(c) whole pool, a straggler", mixed, unit, "both healthy", rate("healthy", both)),
        Figure("(c) whole pool, a straggler", mixed, unit, "sync loop", rate("sync", both)),
        Figure("(c) env-steps delivered + dropped", steps, "", dropped, count["started"], 1, 1),
    ]


class PongFrames(cluster.PongReplay):
    """:class:`bench.cluster.PongReplay` of ``config["frames"]`` (:func:`pong_84`), built
    from a config, as RLlib builds an env."""

    def __init__(self, config: dict[str, np.ndarray]) -> None:
        super().__init__(config["frames"])


def pong_84(count: int) -> np.ndarray:
    """``count`` frames of Pong as RLlib's Atari wrappers make them (grey, 84x84, 4 stacked),
    uint8 (RLlib's then normalises them to float32 in [-1, 1) on the runners)."""
    grey = cluster.pong_frames(count + 3).mean(axis=-1)
    rows, cols = np.linspace(0, 209, 84).astype(int), np.linspace(0, 159, 84).astype(int)
    grey = grey[:, rows][:, :, cols].astype(np.uint8)
    return np.stack([grey[k : k + count] for k in range(4)], axis=-1)


class ChannelsFirst(torch.nn.Module):
    """Frames ``(batch, 84, 84, c)`` as a convolution takes them; uint8 normalised as RLlib's
    wrappers do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2)
        return x.float() / 128 - 1 if x.dtype == torch.uint8 else x


def network(shape: tuple[int, ...], actions: int) -> torch.nn.Module:
    """RLlib's default model's policy side for ``shape``: for frames its Atari CNN (16 8x8/4,
    32 4x4/2, 256 11x11, a linear head), else its MLP (256, 256)."""
    nn = torch.nn
    if len(shape) == 1:
        mlp = [nn.Linear(shape[0], 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()]
        return nn.Sequential(*mlp, nn.Linear(256, actions))
    convs = [nn.Conv2d(shape[-1], 16, 8, 4, padding=2), nn.ReLU()]
    convs += [nn.Conv2d(16, 32, 4, 2, padding=2), nn.ReLU(), nn.Conv2d(32, 256, 11), nn.ReLU()]
    return nn.Sequential(ChannelsFirst(), *convs, nn.Flatten(), nn.Linear(256, actions))


@contextlib.contextmanager
def rllib_rate(env: Any, env_config: dict[str, Any], envs: int, steps: int) -> Iterator[Any]:
    """RLlib's EnvRunnerGroup (:func:`bench.cluster.rllib_group`) open, as ``(rate, params)``:
    ``rate(rounds)`` runs ``rounds`` rounds, each with its runners' own weights synced as PPO
    does (``sync_weights``, a new sequence number) and ``envs x steps`` env-steps sampled by
    each, episodes to the driver, and returns env-steps per driver CPU-second and per CPU-second
    of the whole machine; ``params``: the parameters of the runners' module."""
    from ray.rllib.core import COMPONENT_RL_MODULE
    from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

    with cluster.rllib_group(env, envs, env_config) as group:

        def module(runner: Any) -> Any:
            return runner.get_state(components=[COMPONENT_RL_MODULE], inference_only=True)

        # The weights a learner hands over: the runners' own, under a new number each round.
        state = group.foreach_env_runner(module, local_env_runner=False)[0]
        params = sum(int(np.size(v)) for v in state[COMPONENT_RL_MODULE].values())

        class Source:
            def get_state(self, **_: Any) -> dict[str, Any]:
                state[WEIGHTS_SEQ_NO] = state.get(WEIGHTS_SEQ_NO, 0) + 1
                return dict(state)

        source: Any = Source()

        def once(done: list[int]) -> None:
            group.sync_weights(from_worker_or_learner_group=source, inference_only=True)
            got = group.foreach_env_runner(
                lambda r: r.sample(num_timesteps=envs * steps), local_env_runner=False
            )
            done[0] += sum(len(episode) for episodes in got for episode in episodes)

        def rate(rounds: int) -> tuple[float, float]:
            once([0])
            done, machine = [0], benchmark.busy_cpu_s()
            _, cpu, _ = common.timed(lambda: once(done), rounds)
            return done[0] / cpu, done[0] / (benchmark.busy_cpu_s() - machine)

        yield rate, params


def per_cpu(nodes: list[str], quick: bool, raw: dict[str, Any]) -> list[Figure]:
    """(d): CartPole (2 x 8 envs, 100 steps a round, 10 rounds) and Pong frames (2 x 4 envs,
    50 steps, 12 rounds: the rollouts' memory is in use again from the third; 84x84x4 float32
    as RLlib's Atari wrappers give them, raw and with ``compress="lz4"``, and for envfleet alone
    uint8 normalised in the network), envfleet's pool and RLlib's group open side by side and
    measured in turn, 5 times (medians); the float32 frames on one machine (the process
    backend, 2 workers) against them on the 2 nodes and against RLlib's; one turn of 2 rounds
    with --quick."""
    frames = pong_84(32)
    pong = {"frames": frames.astype(np.float32) / 128 - 1}
    floats = functools.partial(PongFrames, pong)
    cases = {  # envfleet's env, RLlib's env and its config (None: as above), envs a node, steps
        "CartPole": ("CartPole-v1", "CartPole-v1", {}, 8, 100),
        "Pong frames": (floats, PongFrames, pong, 4, 50),
        "Pong frames, compress='lz4'": (floats, PongFrames, pong, 4, 50),
        "Pong frames, uint8": (functools.partial(PongFrames, {"frames": frames}), None, {}, 4, 50),
        "Pong frames, one machine": (floats, None, {}, 4, 50),
    }
    figures: list[Figure] = []
    rllib, rllib_machine, params = 0.0, 0.0, 0
    turns = 1 if quick else 5
    for name, (ours, theirs, config, envs, steps) in cases.items():
        rounds = 2 if quick else 12 - 2 * (steps == 100)
        make: dict[str, Any] = {"backend": "ray", "nodes": nodes, "num_workers": 2, "seed": 0}
        if "lz4" in name:  # the frames a block per step, decompressed into the rollout
            make["compress"] = "lz4"
        if name.endswith("one machine"):  # the process backend's 2 workers, no RLlib
            make = {"backend": "process", "num_workers": 2, "seed": 0}
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(envfleet.make(ours, 2 * envs, **make))
            space, shape = pool.single_action_space, pool.single_observation_space.shape or ()
            module = network(shape, int(space.n))  # type: ignore[attr-defined]
            policy = envfleet.TorchPolicy(module, space, 0)
            theirs_rate = None
            if theirs is not None:
                theirs_rate, params = stack.enter_context(rllib_rate(theirs, config, envs, steps))
            runs, rllib_runs = [], []
            for _ in range(turns):
                runs.append(training.per_cpu(pool, policy, steps, rounds))
                if theirs_rate is not None:
                    rllib_runs.append(theirs_rate(rounds))
        got = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        rate = float(np.median([r["env_steps"] / r["cpu_s"] for r in runs]))
        machine = float(np.median([r["env_steps"] / r["machine_cpu_s"] for r in runs]))
        if rllib_runs:
            rllib = float(np.median([driver for driver, _ in rllib_runs]))
            rllib_machine = float(np.median([whole for _, whole in rllib_runs]))
        size = sum(int(p.numel()) for p in module.parameters())
        raw[f"(d) {name}"] = {
            **got,
            "env_steps_per_cpu_s": [r["env_steps"] / r["cpu_s"] for r in runs],
            "parameters": size,
            "env_steps_per_machine_cpu_s": [r["env_steps"] / r["machine_cpu_s"] for r in runs],
            "rllib": rllib,
            "rllib_machine": rllib_machine,
            "rllib_runs": rllib_runs,
            "rllib parameters": params,
        }
        label = f"(d) {name}: env-steps per driver CPU-s ({size:,} parameters)"
        if "process" in make.values():  # against the nodes, and RLlib's on the same frames
            nodes = next(f for f in figures if f.name.startswith("(d) Pong frames:"))
            figures.append(Figure(label, rate, "", "the same on 2 nodes", nodes.value))
            figures.append(Figure(label, rate, "", nodes.against, nodes.base, 2.0))
            continue
        against = f"RLlib EnvRunnerGroup ({params:,} parameters)"
        figures.append(Figure(label, rate, "", against, rllib, 2.0))
        whole = label.replace("driver CPU-s", "machine CPU-s")
        figures.append(Figure(whole, machine, "", "the same of RLlib's", rllib_machine))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "train.json")
    args = parser.parse_args(argv)
    raw: dict[str, Any] = {}
    with common.script_run(args.json, ("torch", "ray")) as (console, document):
        figures: list[Figure] = []
        with common.fake_cluster(3, [{"pair": 100}] * 2) as fake:
            nodes = [n.node_id for n in fake.worker_nodes]
            figures += overlap(args.quick, raw)
            figures += weights(nodes, args.quick, raw)
            figures += stragglers(nodes, args.quick, raw)
            figures += per_cpu(nodes, args.quick, raw)
        console.print(training.figure_table(figures))
        document["figures"] = [f.as_dict() for f in figures]
        document["measured"] = raw
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
