"""Rollout collection with a PyTorch policy in the loop, every contender side by side.

Random actions with no policy measure the envs alone; in training, the policy's forward pass
sits between every result and the next action. Here a :data:`Policy` (a batch of observations
to a batch of actions) drives each contender through one loop (:class:`Rollout`)::

    obs, ids = stepper.start(seed)
    loop:  actions = policy(obs)           # time in the policy
           stepper.send(actions, ids)      # \\
           obs, ..., ids = stepper.recv()  # /  the policy waits for the envs

A synchronous stepper (``batch == num_envs``) hands every env back at once; an asynchronous one
the first ``batch`` envs ready, so with ``batch = num_envs / 2`` the policy runs on one half
while the other half steps (double buffering, as in Sample Factory and EnvPool's async mode).
Besides env-steps/s (inference included) it reports the share of wall time the *policy waited
for the envs* (inside ``send``/``recv``) and the share of env-time the *envs waited for the
policy* (between a ``recv`` handing them out and the ``send`` of their next actions).

Workloads, each driven by one policy on CPU (``torch.set_num_threads`` chosen and printed):

- ``cartpole``: CartPole-v1 x 64, an MLP (2 x 64) sampling actions;
- ``pong``: Pong x 16 with Gymnasium's standard preprocessing (:func:`bench.envs.make_pong`:
  84x84 grey, frame skip 4, 4 frames stacked) and the Nature-DQN CNN; EnvPool configured alike;
- ``heavy``: :class:`bench.envs.HeavyTailEnv` (90% of steps 0.2 ms, 10% 5 ms) x 32, MLP;
  envfleet on 8 workers of 4 threads (``threads_per_worker=4``).

Contenders: envfleet sync and async (process backend, double-buffered; also with a worker fewer
than cores, leaving one for the policy), Gymnasium ``AsyncVectorEnv``, SB3 ``SubprocVecEnv``,
EnvPool sync and async where it is installed.

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

import importlib.util
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from rich.console import Console

import envfleet
from bench.common import (
    RESULTS,
    Case,
    Versus,
    add_choice,
    measure_table,
    print_machine,
    ratio,
    save_json,
    script_parser,
    session,
    target,
    timing_from,
)
from bench.envs import ENVPOOL_PONG, HeavyTailEnv, make_pong
from envfleet.affinity import usable_cpus
from envfleet.benchmark import Runner, RunResult, Timing, Workload
from envfleet.benchmark.peers import QuietEnvPool

Policy = Callable[[Any], Any]
"""A batch of observations (first axis: envs) -> a batch of actions."""

Record = Callable[[np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray], object]
"""Called with each batch handed to the policy, ``(env_ids, observations, rewards,
terminations, truncations)``: what the envs of the batch returned. The first batch of a
:class:`Rollout` comes from resets, with rewards 0 (an asynchronous stepper hands the other
resets out through ``recv``, with rewards 0 as well)."""


class Stepper(Protocol):
    """One contender's side of the loop."""

    num_envs: int
    batch: int

    def start(self, seed: int) -> tuple[Any, np.ndarray]:
        """Reset every env; the first batch of observations and the envs they belong to."""
        ...

    def send(self, actions: Any, env_ids: np.ndarray) -> None: ...

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(observations, rewards, terminations, truncations, env_ids)`` of a batch."""
        ...

    def close(self) -> None: ...


@dataclass
class Accounting:
    """Where a stretch of the loop's wall time went.

    Attributes:
        num_envs: envs of the stepper.
        wall_s: wall time of the stretch.
        policy_s: time in the policy.
        env_wait_s: time in ``send`` and ``recv`` (the policy waiting for the envs).
        idle_env_s: env-seconds between an env's hand-off by ``recv`` and its next ``send``.
        env_steps: env steps made (a batch of ``b`` envs counts ``b``).
    """

    num_envs: int
    wall_s: float = 0.0
    policy_s: float = 0.0
    env_wait_s: float = 0.0
    idle_env_s: float = 0.0
    env_steps: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.env_steps / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def policy_waited(self) -> float:
        """Share of wall time the policy (the caller) waited for the envs."""
        return self.env_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def envs_waited(self) -> float:
        """Share of env-time the envs waited for the policy (their next actions)."""
        total = self.num_envs * self.wall_s
        return self.idle_env_s / total if total > 0 else 0.0


class Rollout:
    """The loop: a policy driving a stepper, with its time accounted.

    Args:
        stepper: the contender.
        policy: observations -> actions.
        seed: seeds the envs' first reset.
        clock: seconds, monotonic (injectable for tests).
        record: called with each batch's transitions (see :data:`Record`).
    """

    def __init__(
        self,
        stepper: Stepper,
        policy: Policy,
        seed: int = 0,
        *,
        clock: Callable[[], float] = time.perf_counter,
        record: Record | None = None,
    ) -> None:
        self.stepper, self.policy, self.clock, self.record = stepper, policy, clock, record
        self._obs, self._ids = stepper.start(seed)
        self._handed_at = clock()
        if record is not None:
            no = np.zeros(len(self._ids), dtype=np.bool_)
            record(self._ids, self._obs, np.zeros(len(self._ids)), no, no)

    def run(self, *, seconds: float | None = None, batches: int | None = None) -> Accounting:
        """Run for ``seconds`` of wall time or ``batches`` policy calls, whichever is given."""
        if (seconds is None) == (batches is None):
            raise ValueError("give exactly one of seconds and batches")
        acc = Accounting(self.stepper.num_envs)
        clock, stepper, policy, record = self.clock, self.stepper, self.policy, self.record
        obs, ids, handed_at = self._obs, self._ids, self._handed_at
        start = clock()
        deadline = start + seconds if seconds is not None else None
        done = 0
        while True:
            t0 = clock()
            actions = policy(obs)
            t1 = clock()
            stepper.send(actions, ids)
            # An env handed out before this stretch began counts from its start.
            acc.idle_env_s += len(ids) * (t1 - max(handed_at, start))
            obs, rewards, terminations, truncations, ids = stepper.recv()
            t2 = clock()
            handed_at = t2
            acc.policy_s += t1 - t0
            acc.env_wait_s += t2 - t1
            acc.env_steps += len(ids)
            if record is not None:
                record(ids, obs, rewards, terminations, truncations)
            done += 1
            if (deadline is not None and t2 >= deadline) or (
                batches is not None and done >= batches
            ):
                break
        acc.wall_s = clock() - start
        self._obs, self._ids, self._handed_at = obs, ids, handed_at
        return acc


class VectorStepper:
    """Any vector env stepped whole: ``step_async``/``step_wait`` when it has them
    (Gymnasium's ``AsyncVectorEnv``, SB3), else ``step`` in ``recv``."""

    def __init__(self, vec: Any, num_envs: int, *, sb3: bool = False) -> None:
        self.vec, self.num_envs, self.batch, self._sb3 = vec, num_envs, num_envs, sb3
        self._ids = np.arange(num_envs)
        self._split = hasattr(vec, "step_async") and hasattr(vec, "step_wait")
        self._actions: Any = None

    def start(self, seed: int) -> tuple[Any, np.ndarray]:
        if self._sb3:
            self.vec.seed(seed)
            obs = self.vec.reset()
        else:
            obs, _ = self.vec.reset(seed=seed)
        return obs, self._ids

    def send(self, actions: Any, env_ids: np.ndarray) -> None:
        if self._split:
            self.vec.step_async(actions)
        else:
            self._actions = actions

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._sb3:
            obs, rewards, dones, _ = self.vec.step_wait()
            return obs, rewards, dones, np.zeros_like(dones), self._ids
        out = self.vec.step_wait() if self._split else self.vec.step(self._actions)
        obs, rewards, terminations, truncations, _ = out
        return obs, rewards, terminations, truncations, self._ids

    def close(self) -> None:
        self.vec.close()


class BatchStepper:
    """A vector env with EnvPool-style ``async_reset``/``send(actions, env_id)``/``recv`` and
    ``infos["env_id"]`` (envfleet's :class:`~envfleet.Pool`, EnvPool); ``batch`` envs per
    ``recv``, all of them when it is synchronous."""

    def __init__(self, vec: Any, num_envs: int, batch: int) -> None:
        self.vec, self.num_envs, self.batch = vec, num_envs, batch

    def start(self, seed: int) -> tuple[Any, np.ndarray]:
        if isinstance(self.vec, envfleet.Pool):
            self.vec.async_reset(seed=seed)
        else:
            self.vec.async_reset()  # EnvPool: seeded when made
        obs, _, _, _, ids = self.recv()
        return obs, ids

    def send(self, actions: Any, env_ids: np.ndarray) -> None:
        self.vec.send(actions, env_ids)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        obs, rewards, terminations, truncations, infos = self.vec.recv()
        return obs, rewards, terminations, truncations, np.asarray(infos["env_id"])

    def close(self) -> None:
        self.vec.close()


@dataclass(frozen=True)
class RolloutWorkload:
    """A rollout case: the envs, the policy, and how EnvPool builds the same env.

    Attributes:
        name: short name (``pong``).
        workload: the env and how many copies.
        policy: the policy every contender is driven by (one instance, same weights).
        envpool_task: EnvPool's id for the same env, if it ships one.
        envpool_kwargs: EnvPool options that make its env match (preprocessing, ...).
        num_workers: envfleet worker processes (default: usable cores).
        envfleet_kwargs: more :func:`envfleet.make` options for envfleet's contenders (its
            best layout for the env, such as ``threads_per_worker`` for envs that sleep).
    """

    name: str
    workload: Workload
    policy: Policy
    envpool_task: str | None = None
    envpool_kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_workers: int | None = None
    envfleet_kwargs: Mapping[str, Any] = field(default_factory=dict)


def _envfleet(case: RolloutWorkload, batch: int, seed: int, workers: int | None = None) -> Stepper:
    # copy=False: a whole-pool batch, or one worker's block (double buffering on two workers),
    # is the shared memory itself: zero copy into the policy.
    n = case.workload.num_envs
    pool = envfleet.make(
        case.workload.spec, n, backend="process", num_workers=workers or case.num_workers,
        batch_size=batch, seed=seed, copy=False, **case.envfleet_kwargs,
    )  # fmt: skip
    return BatchStepper(pool, n, batch)


def open_envfleet_sync(case: RolloutWorkload, seed: int) -> Stepper:
    """envfleet, process backend, every env per step."""
    return _envfleet(case, case.workload.num_envs, seed)


def open_envfleet_async(case: RolloutWorkload, seed: int) -> Stepper:
    """envfleet, process backend, double-buffered: ``batch_size = num_envs // 2``."""
    return _envfleet(case, max(1, case.workload.num_envs // 2), seed)


def open_envfleet_async_policy_core(case: RolloutWorkload, seed: int) -> Stepper:
    """envfleet async with one worker fewer than usable cores: a core left for the policy."""
    workers = max(1, min(len(usable_cpus()) - 1, case.workload.num_envs))
    return _envfleet(case, max(1, case.workload.num_envs // 2), seed, workers)


def open_gym_async(case: RolloutWorkload, seed: int) -> Stepper:
    """Gymnasium's ``AsyncVectorEnv(shared_memory=True)``: one process per env."""
    from gymnasium.vector import AsyncVectorEnv

    n = case.workload.num_envs
    return VectorStepper(AsyncVectorEnv([case.workload.factory()] * n, shared_memory=True), n)


def open_sb3(case: RolloutWorkload, seed: int) -> Stepper:
    """Stable-Baselines3's ``SubprocVecEnv``: one process per env."""
    from stable_baselines3.common.vec_env import SubprocVecEnv

    n = case.workload.num_envs
    return VectorStepper(SubprocVecEnv([case.workload.factory()] * n), n, sb3=True)


def _envpool(case: RolloutWorkload, batch: int, seed: int) -> Stepper:
    if case.envpool_task is None:
        raise ValueError(f"no EnvPool task matches {case.name}")
    n = case.workload.num_envs
    vec = QuietEnvPool(case.envpool_task, n, batch_size=batch, seed=seed, **case.envpool_kwargs)
    return BatchStepper(vec, n, batch)


CONTENDERS: dict[str, tuple[Callable[[RolloutWorkload, int], Stepper], str | None]] = {
    "envfleet-sync": (open_envfleet_sync, None),
    "envfleet-async": (open_envfleet_async, None),
    "envfleet-async-core": (open_envfleet_async_policy_core, None),
    "gym-async": (open_gym_async, None),
    "sb3": (open_sb3, "stable_baselines3"),
    "envpool": (lambda case, seed: _envpool(case, case.workload.num_envs, seed), "envpool"),
    "envpool-async": (
        lambda case, seed: _envpool(case, max(1, case.workload.num_envs // 2), seed),
        "envpool",
    ),
}
"""Every contender by name, in the order they are run and shown: how to open it, and the
module it needs."""


def unavailable(name: str, case: RolloutWorkload) -> str | None:
    """Why contender ``name`` cannot run ``case`` here, or ``None``."""
    module = CONTENDERS[name][1]
    if module is not None and importlib.util.find_spec(module) is None:
        return "not installed"
    if name.startswith("envpool") and case.envpool_task is None:
        return "unsupported (no matching EnvPool env)"
    return None


class RolloutRunner(Runner):
    """A :class:`Rollout` as a benchmark runner: each window adds its accounting to ``info``
    (``policy_waited`` and ``envs_waited``, one share per window)."""

    def __init__(self, name: str, case: RolloutWorkload, timing: Timing) -> None:
        self.name = name
        start = time.perf_counter()
        stepper = CONTENDERS[name][0](case, timing.seed)
        try:
            self.rollout = Rollout(stepper, case.policy, timing.seed)
            self.setup_s = time.perf_counter() - start
            self.info: dict[str, Any] = {"batch": stepper.batch, "policy_waited": [],
                                         "envs_waited": []}  # fmt: skip
            if isinstance(getattr(stepper, "vec", None), envfleet.Pool):
                self.info["workers"] = stepper.vec.num_workers  # type: ignore[attr-defined]
            self.rollout.run(seconds=timing.warmup)
        except BaseException:
            stepper.close()
            raise
        self._rewarm = timing.rewarm

    def window(self, seconds: float) -> float:
        self.rollout.run(seconds=self._rewarm)
        acc = self.rollout.run(seconds=seconds)
        self.info["policy_waited"].append(acc.policy_waited)
        self.info["envs_waited"].append(acc.envs_waited)
        return acc.steps_per_s

    def close(self) -> None:
        self.rollout.stepper.close()


# -- policies -----------------------------------------------------------------------------------


class TorchPolicy:
    """A PyTorch network that samples a discrete action per observation, on CPU.

    Observations go in through ``torch.from_numpy`` (no copy of float32 arrays; uint8 frames are
    scaled to [0, 1] on the way).
    """

    def __init__(self, net: Any, seed: int = 0) -> None:
        import torch

        self.net = net.eval()
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, obs: Any) -> np.ndarray:
        import torch

        with torch.inference_mode():
            x = torch.from_numpy(np.asarray(obs))
            x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
            probs = torch.softmax(self.net(x), dim=-1)
            actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        out: np.ndarray = actions.numpy()
        return out


def mlp(obs_dim: int, num_actions: int, hidden: int = 64) -> Any:
    """Two hidden layers of ``hidden`` with tanh (CleanRL's PPO actor)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(obs_dim, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, num_actions),
    )


def nature_cnn(num_actions: int, frames: int = 4) -> Any:
    """The Nature-DQN network over ``(frames, 84, 84)`` inputs."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(frames, 32, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512),
        nn.ReLU(),
        nn.Linear(512, num_actions),
    )


# -- the workloads and the script --------------------------------------------------------------


def cartpole(seed: int) -> RolloutWorkload:
    policy = TorchPolicy(mlp(4, 2), seed)
    return RolloutWorkload("cartpole", Workload.of("CartPole-v1", 64), policy, "CartPole-v1")


def pong(seed: int) -> RolloutWorkload:
    policy = TorchPolicy(nature_cnn(6), seed)
    return RolloutWorkload("pong", Workload.of(make_pong, 16), policy, "Pong-v5", ENVPOOL_PONG)


def heavy(seed: int) -> RolloutWorkload:
    # The env mostly sleeps: 8 workers of 4 threads, so that a batch is not held back by the
    # slowest of many envs (a worker replies when all the envs it was sent are done).
    policy = TorchPolicy(mlp(4, 2), seed)
    workload = Workload.of(HeavyTailEnv, 32)
    return RolloutWorkload("heavy", workload, policy, num_workers=8,
                           envfleet_kwargs={"threads_per_worker": 4})  # fmt: skip


WORKLOADS: dict[str, Callable[[int], RolloutWorkload]] = {
    "cartpole": cartpole,
    "pong": pong,
    "heavy": heavy,
}
TARGETS = {  # (numerator, denominator) -> target ratio, per workload
    "pong": {
        ("envfleet-async", "envfleet-sync"): 1.5,
        ("best envfleet", "gym-async"): 1.5,
        ("best envfleet", "sb3"): 1.5,
        ("best envfleet", "envpool"): 1.0,
    },
    "heavy": {
        ("envfleet-async", "envfleet-sync"): 1.5,
        ("best envfleet", "gym-async"): 1.5,
        ("best envfleet", "sb3"): 1.5,
    },
    "cartpole": {("best envfleet", "gym-async"): 1.5, ("best envfleet", "sb3"): 1.5},
}


def share(key: str) -> tuple[str, Callable[[str, RunResult], str]]:
    """A column of the median share ``info[key]`` of a row."""
    header = key.replace("_", " ")
    return header, lambda _, r: f"{np.median(r.info[key]):.0%}" if r.info.get(key) else "-"


def run_workload(
    case: RolloutWorkload, runners: list[str], timing: Timing, console: Console
) -> dict[str, Any]:
    skipped = {name: why for name in runners if (why := unavailable(name, case)) is not None}
    names = [name for name in runners if name not in skipped]
    cases = [Case(n, lambda w, t, n=n: RolloutRunner(n, case, t)) for n in names]
    title = f"{case.name}: {case.workload.label} x {case.workload.num_envs}, policy in the loop"
    base = "envfleet-sync"
    results, rows = measure_table(
        console, title, cases, case.workload, timing,
        [Versus(f"/ {base}", base), share("policy_waited"), share("envs_waited")],
    )  # fmt: skip
    for name, why in skipped.items():
        console.print(f"{name}: {why}", markup=False)
    rates = {n: r.median for n, r in results.items() if isinstance(r, RunResult)}
    ours = [rate for n, rate in rates.items() if n.startswith("envfleet")]
    if ours:
        rates["best envfleet"] = max(ours)
    checks = [
        target(console, f"{a} / {b}", ratio(rates.get(a), rates.get(b)), minimum, end="")
        for (a, b), minimum in TARGETS.get(case.name, {}).items()
    ]
    console.print()
    return {"env": case.workload.label, "num_envs": case.workload.num_envs, "results": rows,
            "skipped": skipped, "targets": checks}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = script_parser(__doc__ or "", RESULTS / "rollout.json")
    add_choice(parser, "--workloads", list(WORKLOADS))
    add_choice(parser, "--runners", list(CONTENDERS))
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    timing = timing_from(args, full=(1.0, 3))
    with session(args.json) as console:
        machine = print_machine(console, ["torch"])
        console.print(f"torch threads {torch.get_num_threads()}")
        report: dict[str, Any] = {"machine": machine, "timing": timing.as_dict(), "workloads": {}}
        report["torch_threads"] = torch.get_num_threads()
        for name in args.workloads:
            torch.manual_seed(args.seed)
            case = WORKLOADS[name](args.seed)
            report["workloads"][name] = run_workload(case, args.runners, timing, console)
    save_json(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
