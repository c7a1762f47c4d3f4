"""The soak's step-by-step checker: :class:`SoakRun` steps one pool of
:class:`~envfleet.benchmark.soak_env.SoakEnv` and checks every result as it comes (see
:mod:`envfleet.benchmark.soak`); :class:`SoakConfig` is what a soak runs."""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

import envfleet
from envfleet.benchmark.soak_env import (
    CALLS,
    ENV_INDEX,
    EPISODE_STEP,
    KINDS,
    POOL_STEP,
    SoakEnv,
    read_log,
)

RESTARTED = "envfleet/restarted"
MAX_EXAMPLES = 10
"""Examples of each kind of mismatch kept for the report."""


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs.

    Attributes:
        steps: env-steps per pool.
        p_fail: probability that an env step fails (in the faulty pool).
        num_envs: envs per pool.
        workers: worker processes per pool (at least 2: a dying worker must not be the only one).
        step_timeout: seconds before a hung worker is killed (each hang costs this much).
        hang_s: how long a hang sleeps.
        kinds: failure kinds to inject, from :data:`~envfleet.benchmark.soak_env.KINDS`.
        episode_steps: episode length (truncated).
        work_us: busy work per env step, microseconds.
        chunks: alternations between the pools.
        seed: the pools' seed.
        baseline: also run the fault-free pool.
        stall_s: a ``pool.step`` taking longer ends the run as stalled (default
            ``max(60, 40 * step_timeout)``).
    """

    steps: int = 1_000_000
    p_fail: float = 1e-4
    num_envs: int = 64
    workers: int = 2
    step_timeout: float = 0.25
    hang_s: float = 60.0
    kinds: tuple[str, ...] = KINDS
    episode_steps: int = 1000
    work_us: float = 0.0
    chunks: int = 10
    seed: int = 0
    baseline: bool = True
    stall_s: float | None = None

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError("workers must be at least 2 (a dying worker must not be the only one)")


class SoakRun:
    """One pool, stepped in chunks, checking every result as it comes."""

    def __init__(self, name: str, p_fail: float, args: SoakConfig, log_dir: str) -> None:
        self.name = name
        self.p_fail = p_fail
        self.num_envs = args.num_envs
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.assignment = [
            tuple(int(i) for i in ids)
            for ids in np.array_split(np.arange(args.num_envs), args.workers)
        ]
        self.worker_of = {i: w for w, ids in enumerate(self.assignment) for i in ids}
        self.pool = envfleet.make(
            SoakEnv,
            args.num_envs,
            backend="process",
            num_workers=args.workers,
            seed=args.seed,
            on_error="restart",
            step_timeout=args.step_timeout,
            max_restarts=10**9,
            context="fork",
            env_kwargs={
                "p_fail": p_fail,
                "kinds": tuple(args.kinds),
                "hang_s": args.hang_s,
                "max_steps": args.episode_steps,
                "log_path": self.log_path,
                "work_us": args.work_us,
            },
        )
        obs, _ = self.pool.reset()
        n = self.num_envs
        self.index = np.arange(n, dtype=np.float64)
        self.actions = np.zeros((n, 2), dtype=np.float64)
        self.actions[:, 0] = self.index
        self.last = obs.copy()
        self.fresh = np.zeros(n, dtype=np.bool_)  # last result flagged: next is a new instance
        self.ended = np.zeros(n, dtype=np.bool_)  # last result ended an episode: next is a reset
        self.step_id = 0
        self.stepping_since: float | None = None
        self.step_seconds = 0.0
        self.step_times: list[float] = []
        self.requested = self.delivered = self.lost = 0
        self.env_steps = self.autoresets = self.env_counted = 0
        self.flags: dict[int, set[int]] = {}
        self.flag_steps: list[tuple[int, float, int]] = []  # (step, seconds, envs flagged)
        self.obs_mismatches: list[dict[str, Any]] = []
        self.flag_field_errors = 0
        self.anomalies: list[dict[str, Any]] = []
        self.anomaly_count = 0
        self.first_reset_ok = bool(
            (obs[:, CALLS] == 1).all()
            and (obs[:, POOL_STEP] == -1).all()
            and (obs[:, EPISODE_STEP] == 0).all()
        )

    def advance(self, count: int) -> None:
        pool, actions, times = self.pool, self.actions, self.step_times
        for _ in range(count):
            s = self.step_id
            actions[:, 1] = s
            start = time.perf_counter()
            self.stepping_since = start
            obs, rewards, terminations, truncations, infos = pool.step(actions)
            self.stepping_since = None
            seconds = time.perf_counter() - start
            times.append(seconds)
            self.step_seconds += seconds
            self._check(s, obs, rewards, terminations, truncations, infos, seconds)
            self.step_id = s + 1

    def _check(
        self,
        s: int,
        obs: np.ndarray,
        rewards: np.ndarray,
        terminations: np.ndarray,
        truncations: np.ndarray,
        infos: dict[str, Any],
        seconds: float,
    ) -> None:
        n, last = self.num_envs, self.last
        self.requested += n
        mask = infos.get(f"_{RESTARTED}")
        flagged = (
            np.zeros(n, dtype=np.bool_)
            if mask is None
            else np.asarray(mask, dtype=np.bool_) & np.asarray(infos[RESTARTED], dtype=np.bool_)
        )
        kept = ~flagged
        lost = int(flagged.sum())
        self.lost += lost
        self.delivered += n - lost
        if lost:
            ids = np.flatnonzero(flagged)
            self.flags[s] = set(ids.tolist())
            self.flag_steps.append((s, seconds, lost))
            same = (obs[ids] == last[ids]).all(axis=1)
            # envfleet's documented exception: an env of a dead or hung worker that finished its
            # step before the failure reports the observation that step produced (its next call).
            stepped = (obs[ids, CALLS] == last[ids, CALLS] + 1) & (obs[ids, POOL_STEP] == s)
            same |= stepped & ~self.fresh[ids]
            for i in ids[~same].tolist():
                self.obs_mismatches.append(
                    {"step": s, "env": i, "last": last[i].tolist(), "got": obs[i].tolist()}
                )
            wrong = (rewards[ids] != 0) | ~truncations[ids] | terminations[ids]
            self.flag_field_errors += int(wrong.sum())
        calls_before = np.where(self.fresh, 0.0, last[:, CALLS])
        resets = (self.fresh | self.ended) & kept
        steps = ~(self.fresh | self.ended) & kept
        reset_ok = (
            (obs[:, POOL_STEP] == -1)
            & (obs[:, EPISODE_STEP] == 0)
            & (obs[:, CALLS] == calls_before + 1)
            & (rewards == 0)
            & ~terminations
            & ~truncations
        )
        step_ok = (
            (obs[:, ENV_INDEX] == self.index)
            & (obs[:, POOL_STEP] == s)
            & (obs[:, CALLS] == calls_before + 1)
            & (obs[:, EPISODE_STEP] == last[:, EPISODE_STEP] + 1)
            & (rewards == 1)
            & ~terminations
        )
        bad = (resets & ~reset_ok) | (steps & ~step_ok)
        if bad.any():
            self.anomaly_count += int(bad.sum())
            for i in np.flatnonzero(bad)[: MAX_EXAMPLES - len(self.anomalies)].tolist():
                self.anomalies.append(
                    {
                        "step": s,
                        "env": i,
                        "expected": "reset" if resets[i] else "step",
                        "last": last[i].tolist(),
                        "got": obs[i].tolist(),
                        "reward": float(rewards[i]),
                    }
                )
        self.env_steps += int(steps.sum())
        self.autoresets += int(resets.sum())
        self.env_counted += int((obs[kept, CALLS] - calls_before[kept]).sum())
        last[kept] = obs[kept]
        self.fresh = flagged
        self.ended = kept & (terminations | truncations)

    def reconcile(self) -> dict[str, Any]:
        """Match the flagged envs of each step against the failures the envs logged."""
        events = read_log(self.log_path)
        expected: dict[int, set[int]] = collections.defaultdict(set)
        for kind, env, step, _pid, _calls in events:
            if kind == "raise":
                expected[step].add(env)
            else:
                expected[step].update(self.assignment[self.worker_of[env]])
        unexplained = {
            s: sorted(ids - expected.get(s, set()))
            for s, ids in self.flags.items()
            if ids - expected.get(s, set())
        }
        missing = {
            s: sorted(ids - self.flags.get(s, set()))
            for s, ids in expected.items()
            if ids - self.flags.get(s, set())
        }
        kinds = collections.Counter(kind for kind, *_ in events)
        replaced = {step for kind, _env, step, *_ in events if kind in ("exit", "hang")}
        whole_workers = {
            s: [
                w
                for w, ids in enumerate(self.assignment)
                if set(ids) <= self.flags[s] and not set(ids) <= expected.get(s, set())
            ]
            for s in unexplained
        }
        collateral = sorted(s for s, ws in whole_workers.items() if ws and s in replaced)
        return {
            "failures_injected": len(events),
            "by_kind": {k: kinds.get(k, 0) for k in KINDS},
            "worker_replacements_expected": kinds.get("exit", 0) + kinds.get("hang", 0),
            "steps_with_unexplained_flags": len(unexplained),
            "unexplained_examples": dict(list(unexplained.items())[:MAX_EXAMPLES]),
            "unexplained_whole_worker_at_another_workers_replacement": collateral,
            "steps_with_missing_flags": len(missing),
            "missing_examples": dict(list(missing.items())[:MAX_EXAMPLES]),
            "events_first": [list(e[:3]) for e in events[:MAX_EXAMPLES]],
            "events": events,
        }

    def summary(self, step_timeout: float) -> dict[str, Any]:
        restarts = self.pool.restarts
        stats = self.pool.stats()
        times = np.array(self.step_times)
        typical = float(np.median(times)) if times.size else 0.0
        overhead = sum(sec - typical for _, sec, _ in self.flag_steps)
        reconciled = self.reconcile()
        hangs = reconciled["by_kind"].get("hang", 0)
        events = reconciled.pop("events")
        own = {(e[2], e[1]) for e in events}
        by_step = collections.defaultdict(list)
        for kind, _env, step, *_ in events:
            by_step[step].append(kind)
        costs: dict[str, list[float]] = collections.defaultdict(list)
        for step, sec, _ in self.flag_steps:
            if len(by_step.get(step, ())) == 1:
                costs[by_step[step][0]].append(sec - typical)
        own_mismatch = sum(1 for m in self.obs_mismatches if (m["step"], m["env"]) in own)
        rate = self.requested / self.step_seconds if self.step_seconds else 0.0
        return {
            "p_fail": self.p_fail,
            "requested": self.requested,
            "delivered": self.delivered,
            "lost_flagged": self.lost,
            "delivered_env_steps": self.env_steps,
            "delivered_autoresets": self.autoresets,
            "counted_by_envs": self.env_counted,
            "restarts_made": int(restarts.sum()),
            "max_restarts_one_env": int(restarts.max()) if restarts.size else 0,
            "stats_restarts": stats.restarts,
            "steps_with_failures": len(self.flag_steps),
            "seconds_stepping": self.step_seconds,
            "steps_per_s": rate,
            "median_step_ms": typical * 1e3,
            "seconds_in_failed_steps_beyond_median": overhead,
            "hang_seconds_expected": hangs * step_timeout,
            "median_extra_seconds_per_failure": {
                k: float(np.median(v)) for k, v in sorted(costs.items())
            },
            "flagged_obs_not_last": len(self.obs_mismatches),
            "flagged_obs_not_last_own_failure": own_mismatch,
            "flagged_obs_not_last_examples": self.obs_mismatches[:MAX_EXAMPLES],
            "flagged_field_errors": self.flag_field_errors,
            "anomalies": self.anomaly_count,
            "anomaly_examples": self.anomalies,
            "first_reset_ok": self.first_reset_ok,
            **reconciled,
        }

    def diagnose(self) -> dict[str, Any]:
        """What the pool is waiting for (:meth:`envfleet.Pool.describe`), its worker processes
        and the last failures injected: what a stall report prints."""
        workers = []
        for child in psutil.Process().children():
            try:
                workers.append({"pid": child.pid, "status": child.status()})
            except psutil.Error:
                continue
        return {
            "pool": self.name,
            "step": self.step_id,
            **self.pool.describe(),
            "child_processes": workers,
            "last_failures": [list(e) for e in read_log(self.log_path)[-5:]],
        }

    def close(self) -> None:
        self.pool.close()
