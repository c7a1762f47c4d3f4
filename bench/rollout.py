"""Rollout collection with a PyTorch policy in the loop, every contender side by side.

In training, the policy's forward pass sits between every result and the next action: here one
policy (observations to actions, one torch thread by default) drives every contender through
the engine's runners (``policy=``), synchronously or double-buffered (``batch = num_envs / 2``:
the policy decides for one half while the other steps). Besides env-steps/s (inference
included): the share of wall time the policy waited for the envs, and of env-time the envs
waited for the policy. Workloads: :data:`WORKLOADS`; contenders: :data:`CONTENDERS`.

Usage::

    python bench/rollout.py                                # all three, a few minutes
    python bench/rollout.py --quick                        # 1 window of 0.5 s each: ~1 minute
    python bench/rollout.py --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import common
from bench.common import Case
from bench.envs import ENVPOOL_PONG, HeavyTailEnv, make_pong
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import Report, Runner, Timing, Workload

Policy = Callable[[Any], Any]
"""A batch of observations (first axis: envs) -> a batch of actions."""


@dataclass(frozen=True)
class RolloutWorkload:
    """A rollout case: the envs, the policy every contender is driven by (one instance), and
    EnvPool's id and options for the same env; envfleet's workers (default: usable cores) and
    more :func:`envfleet.make` options (its best layout for the env)."""

    name: str
    workload: Workload
    policy: Policy
    envpool_task: str | None = None
    envpool_kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_workers: int | None = None
    envfleet_kwargs: Mapping[str, Any] = field(default_factory=dict)


CONTENDERS = (
    "envfleet-sync",
    "envfleet-async",
    "envfleet-async-core",
    "gym-async",
    "sb3",
    "envpool",
    "envpool-async",
)
"""Every contender, in the order they are run and shown (one missing its library, or with no
EnvPool env for the workload, shows as a failed row)."""


def open_contender(name: str, case: RolloutWorkload, policy: Policy, timing: Timing) -> Runner:
    """Contender ``name`` on ``case``, driven by ``policy``. envfleet: the process backend with
    ``copy=False`` (a batch is the shared memory itself: zero copy into the policy); ``async``:
    double-buffered (``batch_size = num_envs / 2``); ``core``: a worker fewer than usable
    cores, one left for the policy."""
    n = case.workload.num_envs
    half = max(1, n // 2) if name.endswith(("async", "core")) else None
    if name.startswith("envfleet"):
        workers = max(1, min(len(usable_cpus()) - 1, n)) if name.endswith("core") else None
        return benchmark.open_envfleet(
            case.workload,
            timing,
            batch_size=half,
            policy=policy,
            backend="process",
            num_workers=workers or case.num_workers,
            copy=False,
            **case.envfleet_kwargs,
        )
    if name.startswith("envpool"):
        return benchmark.open_envpool(
            case.workload,
            timing,
            task=case.envpool_task,
            batch_size=half,
            policy=policy,
            **case.envpool_kwargs,
        )
    opener = benchmark.open_sb3 if name == "sb3" else benchmark.open_gym_async
    return opener(case.workload, timing, policy)


class PolicyRunner(Runner):
    """A contender driven by the case's policy; each window adds to ``info`` the share of wall
    time the policy waited for the envs (``policy_waited``) and the share of env-time the envs
    waited for the policy (``envs_waited``: a batch's envs wait while it decides for them)."""

    def __init__(
        self,
        name: str,
        case: RolloutWorkload,
        _: Workload,
        timing: Timing,
        clock: Callable[[], float] = time.perf_counter,
        opener: Any = open_contender,
    ) -> None:
        self.policy, self.clock, self.policy_s = case.policy, clock, 0.0
        self.inner = opener(name, case, self.decide, timing)
        self.name, self.warmup_s = name, self.inner.warmup_s
        self.batch_share = (self.inner.info.get("batch_size") or 0) / case.workload.num_envs
        self.info = {**self.inner.info, "policy_waited": [], "envs_waited": []}

    def decide(self, obs: Any) -> Any:
        """The policy's actions, its time counted."""
        start = self.clock()
        actions = self.policy(obs)
        self.policy_s += self.clock() - start
        return actions

    def window(self, seconds: float) -> float:
        spent, start = self.policy_s, self.clock()
        rate = self.inner.window(seconds)
        wall, policy_s = self.clock() - start, self.policy_s - spent
        self.info["policy_waited"].append(1 - policy_s / wall)
        self.info["envs_waited"].append((self.batch_share or 1.0) * policy_s / wall)
        return rate

    def close(self) -> None:
        self.inner.close()


def sampled(logits: Callable[[Any], Any]) -> Policy:
    """Actions sampled from ``logits(observations)``, a torch network on CPU (uint8 frames
    scaled to [0, 1]); the networks are the actors of the PPO agents in ``examples/``."""
    import torch

    def policy(obs: Any) -> Any:
        with torch.inference_mode():
            x = torch.from_numpy(np.asarray(obs))
            x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
            return torch.distributions.Categorical(logits=logits(x)).sample().numpy()

    return policy


def mlp_actor() -> Policy:
    """CleanRL's PPO actor for 4 observations, 2 actions: 2 x 64, tanh."""
    from examples.ppo_cartpole import Agent

    return sampled(Agent(4, 2).actor)


def nature_actor() -> Policy:
    """CleanRL's PPO actor for Atari (6 actions): the Nature-DQN network and a linear head."""
    from examples.ppo_atari_async import Agent

    agent = Agent(6)
    return sampled(lambda x: agent.actor(agent.network(x)))


WORKLOADS: dict[str, Callable[[], RolloutWorkload]] = {
    "cartpole": lambda: RolloutWorkload(
        "cartpole", Workload.of("CartPole-v1", 64), mlp_actor(), "CartPole-v1"
    ),
    "pong": lambda: RolloutWorkload(
        "pong", Workload.of(make_pong, 16), nature_actor(), "Pong-v5", ENVPOOL_PONG
    ),
    # The env mostly sleeps: 8 workers of 4 threads, so that a batch is not held back by the
    # slowest of many envs (a worker replies when all the envs it was sent are done).
    "heavy": lambda: RolloutWorkload(
        "heavy",
        Workload.of(HeavyTailEnv, 32),
        mlp_actor(),
        num_workers=8,
        envfleet_kwargs={"threads_per_worker": 4},
    ),
}
SYNC_TARGETS = {("envfleet-async", "envfleet-sync"): 1.5}
PEER_TARGETS = {("best envfleet", "gym-async"): 1.5, ("best envfleet", "sb3"): 1.5}
TARGETS = {  # (numerator, denominator) -> target ratio, per workload
    "pong": {**SYNC_TARGETS, **PEER_TARGETS, ("best envfleet", "envpool"): 1.0},
    "heavy": {**SYNC_TARGETS, **PEER_TARGETS},
    "cartpole": PEER_TARGETS,
}


def share(key: str) -> tuple[str, Callable[[Report, str, int], str]]:
    """A column of the median share ``info[key]`` of a row."""

    def cell(report: Report, name: str, n: int) -> str:
        return f"{np.median(report.results[name][n].info[key]):.0%}"  # type: ignore[union-attr]

    return key.replace("_", " "), cell


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = common.script_parser(__doc__ or "", common.RESULTS / "rollout.json")
    common.add_choice(parser, "--workloads", list(WORKLOADS))
    common.add_choice(parser, "--runners", list(CONTENDERS))
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    timing = common.timing_from(args, full=(1.0, 3))
    with common.script_run(args.json, ["torch"]) as (console, report):
        threads = report["torch_threads"] = torch.get_num_threads()
        console.print(f"torch threads {threads}")
        report["workloads"] = {}
        for name in args.workloads:
            torch.manual_seed(args.seed)
            case = WORKLOADS[name]()
            cases = [Case(r, functools.partial(PolicyRunner, r, case)) for r in args.runners]
            n = case.workload.num_envs
            title = f"{case.name}: {case.workload.label} x {n}, policy in the loop"
            columns = [share("policy_waited"), share("envs_waited")]
            measured = common.measure_table(
                console, title, cases, case.workload, timing, "envfleet-sync", columns
            )
            rates = {r: measured.rate(r, n) for r in args.runners}
            ours = [rate for r, rate in rates.items() if r.startswith("envfleet") and rate]
            rates["best envfleet"] = max(ours, default=None)
            checks = []
            for (a, b), minimum in TARGETS[name].items():
                top, bottom = rates.get(a), rates.get(b)
                value = top / bottom if top and bottom else None
                checks.append(common.target(console, f"{a} / {b}", value, minimum, end=""))
            report["workloads"][name] = {**common.rows(measured), "targets": checks}
    return 0


if __name__ == "__main__":
    sys.exit(main())
