"""Fault tolerance soak: envs that raise, exit or hang at random; every step accounted for.

Runs two pools of :class:`bench.soak_envs.SoakEnv` side by side in one process, stepping them in
alternating chunks (so that load from elsewhere hits both alike): one whose envs fail with
probability ``--p-fail`` per step (raise an exception, ``os._exit`` their worker, or hang until
``step_timeout`` kills it, chosen uniformly) and a fault-free one (probability 0), both made
with ``on_error="restart"`` and the same ``step_timeout``. Failures are drawn from each env's
seeded RNG, so a run is reproducible.

Each env echoes ``[env index, pool step id]`` from its action and counts its own calls in its
observation, and logs every failure it injects. The driver checks, step by step:

- every result is either delivered or flagged ``infos["envfleet/restarted"]`` (lost), and
  ``delivered + lost == requested``; ``lost == sum(pool.restarts)``;
- a delivered result is the next call of its env instance (its counter advanced by exactly 1,
  the action's step id echoed; after an episode end or a restart, a reset of the same or of a
  fresh instance): no step silently lost, repeated or given to the wrong env;
- a flagged result has reward 0, ``truncated``, and the env's last observation (NEXT_STEP), or,
  for an env of a dead or hung worker that finished its step before the failure, the
  observation that step produced;
- the flagged envs of each step are exactly those the injected failures account for (the env
  that raised; every env of the worker that exited or hung).

It prints failures injected, restarts made and steps/s against the fault-free pool (target:
at least 0.9x). Note: a hang costs one ``step_timeout`` of wall time per occurrence (the whole
sync step waits for it), and a dead worker is replaced by a new process (fork + rebuild of its
envs); both are reported. Exit status: 0 when every check holds, 1 when one fails, 2 when a
``pool.step`` stalls for ``--stall-s`` (the pool's state is then printed and written to the JSON).

Usage::

    python bench/soak.py                      # 10^6 steps x 2 pools, p=1e-4: 30-40 s on 2 cores
    python bench/soak.py --quick              # 50k steps, p=1e-3 (so failures happen): ~10 s
    python bench/soak.py --steps 2000000 --workers 4 --step-timeout 0.5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import collections
import faulthandler
import json
import math
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np

import envfleet
from bench.async_bench import RESULTS
from bench.soak_envs import (
    CALLS,
    ENV_INDEX,
    EPISODE_STEP,
    KINDS,
    OBS_SIZE,
    POOL_STEP,
    SoakEnv,
    read_log,
)
from envfleet.benchmark import machine_info
from envfleet.benchmark.cases import save_json

TARGET = 0.9
RESTARTED = "envfleet/restarted"
MAX_EXAMPLES = 10


class SoakRun:
    """One pool, stepped in chunks, checking every result as it comes."""

    def __init__(self, name: str, p_fail: float, args: argparse.Namespace, log_dir: str) -> None:
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
        """What the pool is waiting for (its private state: for a stall report only)."""
        pool = self.pool
        pending = getattr(pool, "_pending", None)
        state = getattr(pool, "_state", None)
        transport = getattr(pool, "_transport", None)
        procs = getattr(transport, "_procs", None) or []
        return {
            "pool": self.name,
            "step": self.step_id,
            "pending_per_worker": [
                [f"{type(c).__name__}{tuple(getattr(c, 'env_ids', ()))}" for c in d]
                for d in (pending or [])
            ],
            "envs_in_flight": [] if state is None else np.flatnonzero(state == 1).tolist(),
            "envs_ready": [] if state is None else np.flatnonzero(state == 2).tolist(),
            "workers_alive": list(getattr(transport, "_alive", [])),
            "worker_pids": [p.pid for p in procs],
            "restarts": self.pool.restarts.tolist(),
            "last_failures": [list(e) for e in read_log(self.log_path)[-5:]],
        }

    def close(self) -> None:
        self.pool.close()


def start_watchdog(
    runs: dict[str, SoakRun], stall_s: float, report: dict[str, Any], path: Path
) -> None:
    """Report and end the run if one ``pool.step`` takes longer than ``stall_s``.

    A stall is a failure of the run ("the run completes" is what the soak checks): the pool's
    state and this process's stacks are printed and written to the JSON, then the process
    exits with status 2 (its workers follow: they watch their parent).
    """

    def watch() -> None:
        while True:
            time.sleep(min(1.0, stall_s / 4))
            for run in list(runs.values()):
                since = run.stepping_since
                if since is None or time.perf_counter() - since < stall_s:
                    continue
                diagnosis = run.diagnose()
                print(
                    f"\nSTALLED: {run.name} pool.step at step {run.step_id} has not returned "
                    f"in {stall_s:g} s\n{json.dumps(diagnosis, indent=1)}",
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
                sys.stdout.flush()
                report["stalled"] = diagnosis
                report["all_checks_passed"] = False
                try:
                    save_json(path, report)
                finally:
                    os._exit(2)

    threading.Thread(target=watch, name="soak-watchdog", daemon=True).start()


def checks(faulty: dict[str, Any], clean: dict[str, Any]) -> dict[str, bool]:
    """The accounting checks; every one must hold."""
    out = {}
    for label, run in (("faulty", faulty), ("fault_free", clean)):
        out[f"{label}: delivered + lost == requested"] = (
            run["delivered"] + run["lost_flagged"] == run["requested"]
        )
        out[f"{label}: lost == restarts made"] = run["lost_flagged"] == run["restarts_made"]
        out[f"{label}: every delivered result is the next call of its env"] = (
            run["anomalies"] == 0 and run["counted_by_envs"] == run["delivered"]
        )
        out[f"{label}: flagged results are truncated with reward 0"] = (
            run["flagged_field_errors"] == 0
        )
        out[f"{label}: flagged results carry the env's last observation"] = (
            run["flagged_obs_not_last"] == 0
        )
        out[f"{label}: flagged envs == those the injected failures account for"] = (
            run["steps_with_unexplained_flags"] == 0 and run["steps_with_missing_flags"] == 0
        )
        out[f"{label}: first reset"] = run["first_reset_ok"]
    out["fault_free: nothing flagged"] = clean["lost_flagged"] == 0
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=None, help="env steps per pool (1e6)")
    parser.add_argument("--p-fail", type=float, default=None, help="per step (1e-4)")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=0.25,
        help="seconds before a hung worker is killed (default 0.25; each hang costs this)",
    )
    parser.add_argument("--hang-s", type=float, default=60.0, help="how long a hang sleeps")
    parser.add_argument("--kinds", default=",".join(KINDS), help="failure kinds to inject")
    parser.add_argument("--episode-steps", type=int, default=1000)
    parser.add_argument(
        "--work-us", type=float, default=0.0, help="busy work per env step, microseconds"
    )
    parser.add_argument("--chunks", type=int, default=None, help="alternations (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    parser.add_argument(
        "--quick", action="store_true", help="50k steps with p=1e-3, so failures happen"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free pool")
    parser.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="a pool.step taking longer than this ends the run as stalled "
        "(default max(60, 40 x step_timeout))",
    )
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if args.steps is None:
        args.steps = 50_000 if args.quick else 1_000_000
    if args.p_fail is None:
        args.p_fail = 1e-3 if args.quick else 1e-4
    if args.chunks is None:
        args.chunks = 4 if args.quick else 10
    if args.workers < 2:
        parser.error("--workers must be at least 2 (a dying worker must not be the only one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(("ale-py",))
    pool_steps = math.ceil(args.steps / args.num_envs)
    chunks = max(1, min(args.chunks, pool_steps))
    sizes = [len(c) for c in np.array_split(np.arange(pool_steps), chunks)]
    print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, load average "
        f"{machine['load_average_at_start'][0]:.2f}\n"
        f"{args.num_envs} envs over {args.workers} workers, {pool_steps * args.num_envs:,} steps "
        f"per pool in {chunks} alternating chunks; p_fail={args.p_fail:g} per step "
        f"({', '.join(args.kinds)}), step_timeout={args.step_timeout:g} s, on_error=restart"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="envfleet-soak-") as log_dir:
        runs: dict[str, SoakRun] = {}
        try:
            stall_s = args.stall_s or max(60.0, 40 * args.step_timeout)
            start_watchdog(runs, stall_s, {"machine": machine, "args": vars(args)}, args.json)
            runs["faulty"] = SoakRun("faulty", args.p_fail, args, log_dir)
            if not args.no_baseline:
                runs["fault_free"] = SoakRun("fault_free", 0.0, args, log_dir)
            for k, size in enumerate(sizes):
                order = list(runs.values())
                if k % 2:
                    order.reverse()
                for run in order:
                    run.advance(size)
                rates = "  ".join(
                    f"{run.name} {run.requested / max(run.step_seconds, 1e-9):,.0f} steps/s "
                    f"({run.lost} lost)"
                    for run in runs.values()
                )
                print(f"chunk {k + 1}/{chunks}: {rates}", flush=True)
            summaries = {name: run.summary(args.step_timeout) for name, run in runs.items()}
        finally:
            for run in runs.values():
                run.close()
    wall = time.perf_counter() - started
    faulty = summaries["faulty"]
    clean = summaries.get("fault_free")
    ratio = faulty["steps_per_s"] / clean["steps_per_s"] if clean else None
    results = checks(faulty, clean) if clean else {}
    print()
    for name, run in summaries.items():
        print(
            f"{name}: requested {run['requested']:,} = delivered {run['delivered']:,} "
            f"+ lost {run['lost_flagged']:,}; restarts {run['restarts_made']:,}; "
            f"{run['steps_per_s']:,.0f} steps/s (median step {run['median_step_ms']:.2f} ms)"
        )
    kinds = ", ".join(f"{k} {v}" for k, v in faulty["by_kind"].items())
    print(
        f"failures injected: {faulty['failures_injected']} ({kinds}); "
        f"worker replacements: {faulty['worker_replacements_expected']}; "
        f"envs restarted: {faulty['restarts_made']} (max {faulty['max_restarts_one_env']} "
        f"for one env)"
    )
    print(
        f"time in the {faulty['steps_with_failures']} steps with failures, beyond a median step: "
        f"{faulty['seconds_in_failed_steps_beyond_median']:.2f} s, of which hangs "
        f"{faulty['by_kind'].get('hang', 0)} x {args.step_timeout:g} s = "
        f"{faulty['hang_seconds_expected']:.2f} s"
    )
    costs = ", ".join(
        f"{k} {v * 1e3:.0f} ms" for k, v in faulty["median_extra_seconds_per_failure"].items()
    )
    print(f"median extra time of a step with one failure: {costs}")
    if faulty["steps_with_unexplained_flags"]:
        print(
            f"steps with flagged envs no injected failure accounts for: "
            f"{faulty['steps_with_unexplained_flags']} "
            f"(a whole healthy worker flagged at the step another worker was replaced: "
            f"{faulty['unexplained_whole_worker_at_another_workers_replacement']})"
        )
    if faulty["flagged_obs_not_last"]:
        print(
            f"flagged results whose observation is not the env's last: "
            f"{faulty['flagged_obs_not_last']} ({faulty['flagged_obs_not_last_own_failure']} "
            "of the failing env itself; the rest are envs of a worker that died or hung, "
            "stepped before the failing env in that command)"
        )
    verdict = None
    if ratio is not None:
        verdict = ratio >= TARGET
        without = faulty["seconds_stepping"] - faulty["hang_seconds_expected"]
        ratio_no_hangs = faulty["requested"] / without / clean["steps_per_s"] if without else None
        print(
            f"faulty / fault-free steps/s = {ratio:.3f} (target >= {TARGET}) "
            f"{'met' if verdict else 'missed'}; without the hang waits: "
            f"{ratio_no_hangs:.3f}"
        )
        budget = faulty["requested"] / clean["steps_per_s"] * (1 / TARGET - 1)
        per_failure = budget / faulty["failures_injected"] if faulty["failures_injected"] else None
        print(
            f"for {TARGET}x the failures may cost {budget:.2f} s in all here (the fault-free "
            f"pool takes {faulty['requested'] / clean['steps_per_s']:.1f} s): "
            f"{(per_failure or 0) * 1e3:.0f} ms per failure"
        )
    failed = [name for name, ok in results.items() if not ok]
    for name, ok in results.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    print(f"wall time {wall:.1f} s")
    report = {
        "machine": machine,
        "config": {
            "steps_per_pool": pool_steps * args.num_envs,
            "num_envs": args.num_envs,
            "workers": args.workers,
            "p_fail": args.p_fail,
            "kinds": args.kinds,
            "step_timeout": args.step_timeout,
            "hang_s": args.hang_s,
            "episode_steps": args.episode_steps,
            "work_us": args.work_us,
            "chunks": chunks,
            "seed": args.seed,
            "obs_columns": ["env_index", "pool_step", "calls", "episode_step", "episodes"],
            "obs_size": OBS_SIZE,
        },
        "faulty": faulty,
        "fault_free": clean,
        "ratio_faulty_over_fault_free": ratio,
        "target": TARGET,
        "meets_target": verdict,
        "checks": results,
        "all_checks_passed": not failed,
        "wall_seconds": wall,
        "failure_budget_seconds_for_target": (
            faulty["requested"] / clean["steps_per_s"] * (1 / TARGET - 1) if clean else None
        ),
        "median_step_ms_ratio": (
            faulty["median_step_ms"] / clean["median_step_ms"] if clean else None
        ),
    }
    save_json(args.json, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
