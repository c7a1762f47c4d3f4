"""Rollout collection with a policy in the loop: the same loop for every vector env.

Random actions with no policy measure the envs alone; in training, the policy's forward pass
sits between every result and the next action. Here a :data:`Policy` (a callable from a batch of
observations to a batch of actions, such as a PyTorch network on CPU) drives each contender
through one loop::

    obs, ids = stepper.start(seed)
    loop:  actions = policy(obs)           # time in the policy
           stepper.send(actions, ids)      # \\
           obs, ..., ids = stepper.recv()  # /  the policy waits for the envs

A *stepper* (:class:`Stepper`) is the contender's side of that loop. A synchronous one
(``batch == num_envs``) hands every env back at once; an asynchronous one hands back the first
``batch`` envs ready, so with ``batch = num_envs / 2`` the policy runs on one half while the
other half steps (double buffering, as in Sample Factory and EnvPool's async mode).

What :class:`Accounting` reports besides env-steps per second (inference included):

- *policy waited for envs*: the share of wall time the caller spent inside ``send``/``recv``;
- *envs waited for the policy*: the share of env-time that envs spent handed to the caller,
  between a ``recv`` returning them and the ``send`` of their next actions (a synchronous
  stepper leaves every env idle while the policy runs; double buffering only the half that the
  policy is working on).

Contenders (:data:`ROLLOUT_RUNNERS`): ``envfleet-sync``, ``envfleet-async`` (process backend,
default workers), ``envfleet-async-core`` (async, a worker fewer than usable cores: one core is
left for the policy), ``gym-async`` (Gymnasium ``AsyncVectorEnv``, shared memory), ``sb3``
(``SubprocVecEnv``), ``envpool`` and ``envpool-async`` (EnvPool's own envs, where the
workload says which task and options match it). :class:`RolloutRunner` is a
:class:`~envfleet.benchmark.Runner`, so :func:`~envfleet.benchmark.measure` times them in
interleaved windows.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from rich.table import Table

import envfleet
from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import Runner, RunResult, Timing, Workload

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


# -- the contenders --------------------------------------------------------------------------


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


def _envfleet(
    case: RolloutWorkload, batch: int, seed: int, num_workers: int | None = None
) -> Stepper:
    n = case.workload.num_envs
    # copy=False: a whole-pool batch, or one worker's block (double buffering on two workers),
    # is the shared memory itself: zero copy into the policy.
    pool = envfleet.make(
        case.workload.spec,
        n,
        backend="process",
        num_workers=num_workers or case.num_workers,
        batch_size=batch,
        seed=seed,
        copy=False,
        **case.envfleet_kwargs,
    )
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
    import envpool
    import gymnasium

    if case.envpool_task is None:
        raise ValueError(f"no EnvPool task matches {case.name}")
    n = case.workload.num_envs
    level = gymnasium.logger.min_level
    gymnasium.logger.min_level = gymnasium.logger.ERROR  # its spaces' dtype warnings
    try:
        vec = envpool.make(
            case.envpool_task,
            env_type="gymnasium",
            num_envs=n,
            batch_size=batch,
            seed=seed,
            **case.envpool_kwargs,
        )
    finally:
        gymnasium.logger.min_level = level
    return BatchStepper(vec, n, batch)


def open_envpool(case: RolloutWorkload, seed: int) -> Stepper:
    """EnvPool's own env, synchronous (``batch_size = num_envs``)."""
    return _envpool(case, case.workload.num_envs, seed)


def open_envpool_async(case: RolloutWorkload, seed: int) -> Stepper:
    """EnvPool's own env, async mode with ``batch_size = num_envs // 2``."""
    return _envpool(case, max(1, case.workload.num_envs // 2), seed)


@dataclass(frozen=True)
class RolloutKind:
    """A contender by name: how to open it, and what it needs."""

    name: str
    open: Callable[[RolloutWorkload, int], Stepper]
    module: str | None = None
    needs_envpool_task: bool = False

    def unavailable(self, case: RolloutWorkload) -> str | None:
        """Why this contender cannot run ``case`` here, or ``None``."""
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return "not installed"
        if self.needs_envpool_task and case.envpool_task is None:
            return "unsupported (no matching EnvPool env)"
        return None


ROLLOUT_RUNNERS: dict[str, RolloutKind] = {
    kind.name: kind
    for kind in (
        RolloutKind("envfleet-sync", open_envfleet_sync),
        RolloutKind("envfleet-async", open_envfleet_async),
        RolloutKind("envfleet-async-core", open_envfleet_async_policy_core),
        RolloutKind("gym-async", open_gym_async),
        RolloutKind("sb3", open_sb3, "stable_baselines3"),
        RolloutKind("envpool", open_envpool, "envpool", needs_envpool_task=True),
        RolloutKind("envpool-async", open_envpool_async, "envpool", needs_envpool_task=True),
    )
}
"""Every contender by name, in the order they are run and shown."""


class RolloutRunner(Runner):
    """A :class:`Rollout` as a benchmark runner: each window adds its accounting to ``info``
    (``policy_waited`` and ``envs_waited``, one share per window)."""

    def __init__(self, name: str, case: RolloutWorkload, timing: Timing) -> None:
        self.name = name
        start = time.perf_counter()
        stepper = ROLLOUT_RUNNERS[name].open(case, timing.seed)
        try:
            self.rollout = Rollout(stepper, case.policy, timing.seed)
            self.setup_s = time.perf_counter() - start
            self.info: dict[str, Any] = {
                "batch": stepper.batch,
                "policy_waited": [],
                "envs_waited": [],
            }
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


def rollout_openers(
    case: RolloutWorkload, names: Sequence[str]
) -> dict[str, Callable[[Workload, Timing], Runner]]:
    """Openers of the rollout runners ``names`` over ``case``, for
    :func:`~envfleet.benchmark.measure`'s ``openers``."""

    def opener(name: str) -> Callable[[Workload, Timing], Runner]:
        def open_runner(workload: Workload, timing: Timing) -> Runner:
            return RolloutRunner(name, case, timing)

        return open_runner

    return {name: opener(name) for name in names}


def rollout_table(
    case: RolloutWorkload,
    results: Mapping[str, RunResult | str],
    timing: Timing,
    skipped: Mapping[str, str] | None = None,
    reference: str = "envfleet-sync",
) -> Table:
    """One row per contender: env-steps/s (median), its ratio to ``reference``, and the median
    shares of wall time the policy waited for envs and envs waited for the policy."""
    title = (
        f"{case.name}: {case.workload.label} x {case.workload.num_envs}, policy in the loop, "
        f"env-steps/s, median of {timing.repeats} x {timing.seconds:g} s"
    )
    table = Table(title=title, title_justify="left")
    for column in ("runner", "steps/s", f"/ {reference}", "policy waited", "envs waited"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    base = results.get(reference)
    base_rate = base.median if isinstance(base, RunResult) else None
    for name, result in results.items():
        if isinstance(result, str):
            table.add_row(name, f"[red]failed[/red] {result[:60]}", "-", "-", "-")
            continue
        ratio = f"{result.median / base_rate:.2f}" if base_rate else "-"
        shares = [
            f"{float(np.median(result.info[key])):.0%}" if result.info.get(key) else "-"
            for key in ("policy_waited", "envs_waited")
        ]
        table.add_row(name, f"{result.median:,.0f}", ratio, *shares)
    for name, reason in (skipped or {}).items():
        table.add_row(name, reason, "-", "-", "-")
    return table


def ratios(results: Mapping[str, RunResult | str], names: Sequence[str]) -> dict[str, float]:
    """``"a/b"`` -> median(a) / median(b) for every pair of measured names, in order."""
    rates = {n: r.median for n, r in results.items() if isinstance(r, RunResult) and n in names}
    return {f"{a}/{b}": rates[a] / rates[b] for a in rates for b in rates if a != b and rates[b]}
