"""Fault tolerance soak: envs that raise, exit or hang at random; every step accounted for.

Two pools of :class:`bench.envs.SoakEnv` stepped in alternating chunks, both with
``on_error="restart"``: one whose envs fail with probability ``--p-fail`` per step (raise,
``os._exit`` the worker, or hang until ``step_timeout``), and a fault-free one. Every result is
checked as it comes (:func:`soak_checks`: every step delivered or flagged
``infos["envfleet/restarted"]``, each where it belongs). Target: the faulty pool at least 0.9x
the fault-free one. Exit status 0 when every check holds, 1 when one fails, 2 when a
``pool.step`` stalls for ``--stall-s`` (a watchdog prints :meth:`envfleet.Pool.describe`).

Usage::

    python bench/soak.py                      # 10^6 steps x 2 pools, p=1e-4: 30-40 s on 2 cores
    python bench/soak.py --quick              # 50k steps, p=1e-3 (so failures happen): ~10 s
    python bench/soak.py --steps 2000000 --workers 4 --step-timeout 0.5
    python bench/soak.py --nodes 3 --workers 6 --steps 20000 --p-fail 0.01 --step-timeout 1
                                              # node sub-pools on a fake 3-node Ray cluster
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import collections
import dataclasses
import faulthandler
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil
from rich.console import Console

import envfleet
from bench.common import RESULTS, fake_cluster, print_machine, save_json
from bench.envs import CALLS, ENV_INDEX, EPISODE_STEP, KINDS, POOL_STEP, SoakEnv, read_log

RESTARTED = "envfleet/restarted"
MAX_EXAMPLES = 10
"""Examples of each kind of mismatch kept for the report."""


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs (each field is an option: ``--p-fail``, ``--kinds raise,exit``, ...)."""

    steps: int = 1_000_000  # env-steps per pool
    p_fail: float = 1e-4  # probability that an env step fails (in the faulty pool)
    num_envs: int = 64  # envs per pool
    workers: int = 2  # worker processes per pool: at least 2, a dying one must not be the only
    step_timeout: float = 0.25  # seconds before a hung worker is killed (each hang costs this)
    hang_s: float = 60.0  # how long a hang sleeps
    kinds: tuple[str, ...] = KINDS  # failure kinds to inject, from bench.envs.KINDS
    episode_steps: int = 1000  # episode length (truncated)
    work_us: float = 0.0  # busy work per env step, microseconds
    chunks: int = 10  # alternations between the pools
    seed: int = 0  # the pools' seed
    stall_s: float | None = None  # a longer pool.step stalls the run (max(60, 40 x timeout))
    nodes: int = 0  # > 0: node sub-pools (backend="ray") over a fake Ray cluster of this many

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
        blocks = np.array_split(np.arange(args.num_envs), args.workers)
        self.assignment = [tuple(ids.tolist()) for ids in blocks]
        self.worker_of = {i: w for w, ids in enumerate(self.assignment) for i in ids}
        env: dict[str, Any] = dict(p_fail=p_fail, kinds=tuple(args.kinds), hang_s=args.hang_s)
        env.update(log_path=self.log_path, max_steps=args.episode_steps, work_us=args.work_us)
        where: dict[str, Any] = {"backend": "process", "context": "fork"}
        if args.nodes:  # every node of the fake cluster (ray.init'ed by run_soak)
            import ray

            where = {"backend": "ray", "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]]}
        self.pool = envfleet.make(
            SoakEnv,
            args.num_envs,
            num_workers=args.workers,
            seed=args.seed,
            on_error="restart",
            step_timeout=args.step_timeout,
            max_restarts=10**9,
            env_kwargs=env,
            **where,
        )
        obs, _ = self.pool.reset()
        n = self.num_envs
        self.index = np.arange(n, dtype=np.float64)
        self.actions = np.stack([self.index, np.zeros(n)], axis=1)  # [env index, pool step]
        self.last = obs.copy()
        self.fresh = np.zeros(n, dtype=np.bool_)  # last result flagged: next is a new instance
        self.ended = np.zeros(n, dtype=np.bool_)  # last result ended an episode: next is a reset
        self.step_id = 0
        self.stepping_since: float | None = None
        self.step_seconds = 0.0
        self.step_times: list[float] = []
        self.requested = self.delivered = self.lost = self.env_counted = 0
        self.flags: dict[int, set[int]] = {}
        self.flag_steps: list[tuple[int, float, int]] = []  # (step, seconds, envs flagged)
        self.obs_mismatches: list[dict[str, Any]] = []
        self.anomalies: list[dict[str, Any]] = []
        self.flag_field_errors = self.anomaly_count = 0
        self.first_reset_ok = bool((obs[:, [CALLS, POOL_STEP, EPISODE_STEP]] == [1, -1, 0]).all())

    def advance(self, count: int) -> None:
        pool, actions, times = self.pool, self.actions, self.step_times
        for _ in range(count):
            s = self.step_id
            actions[:, 1] = s
            self.stepping_since = start = time.perf_counter()
            result = pool.step(actions)
            self.stepping_since = None
            seconds = time.perf_counter() - start
            times.append(seconds)
            self.step_seconds += seconds
            self._check(s, result, seconds)
            self.step_id = s + 1

    def _check(self, s: int, result: tuple[Any, ...], seconds: float) -> None:
        obs, rewards, terminations, truncations, infos = result
        n, last = self.num_envs, self.last
        self.requested += n
        none = np.zeros(n, dtype=np.bool_)
        flagged = infos.get(f"_{RESTARTED}", none) & np.asarray(infos.get(RESTARTED, none), bool)
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
                example = {"step": s, "env": i, "expected": "reset" if resets[i] else "step"}
                example.update(last=last[i].tolist(), got=obs[i].tolist(), reward=float(rewards[i]))
                self.anomalies.append(example)
        self.env_counted += int((obs[kept, CALLS] - calls_before[kept]).sum())
        last[kept] = obs[kept]
        self.fresh = flagged
        self.ended = kept & (terminations | truncations)

    def reconcile(self, events: list[tuple[str, int, int, int, int]]) -> dict[str, Any]:
        """Match the flagged envs of each step against the failures the envs logged: a raise
        flags its env, an exit or a hang its worker's envs."""
        expected: dict[int, set[int]] = collections.defaultdict(set)
        for kind, env, step, _pid, _calls in events:
            ids = {env} if kind == "raise" else set(self.assignment[self.worker_of[env]])
            expected[step] |= ids

        def beyond(got: dict[int, set[int]], other: dict[int, set[int]]) -> dict[int, list[int]]:
            return {s: sorted(d) for s, ids in got.items() if (d := ids - other.get(s, set()))}

        unexplained, missing = beyond(self.flags, expected), beyond(expected, self.flags)
        kinds = collections.Counter(kind for kind, *_ in events)
        near = {  # the failures injected on or just before each of the first unexplained steps
            s: [list(e[:3]) for e in events if s - 2 <= e[2] <= s]
            for s in list(unexplained)[:MAX_EXAMPLES]
        }
        return {
            "failures_injected": len(events),
            "by_kind": {k: kinds.get(k, 0) for k in KINDS},
            "steps_with_unexplained_flags": len(unexplained),
            "unexplained_near": {str(k): v for k, v in near.items()},
            "unexplained_examples": dict(list(unexplained.items())[:MAX_EXAMPLES]),
            "steps_with_missing_flags": len(missing),
            "missing_examples": dict(list(missing.items())[:MAX_EXAMPLES]),
        }

    def summary(self, step_timeout: float) -> dict[str, Any]:
        events = read_log(self.log_path)
        typical = float(np.median(self.step_times)) if self.step_times else 0.0
        by_step = collections.defaultdict(list)
        for kind, _env, step, *_ in events:
            by_step[step].append(kind)
        costs: dict[str, list[float]] = collections.defaultdict(list)
        for step, sec, _ in self.flag_steps:
            if len(by_step.get(step, ())) == 1:  # steps with one failure: its cost alone
                costs[by_step[step][0]].append(sec - typical)
        restarts = self.pool.restarts
        return {
            "p_fail": self.p_fail,
            "requested": self.requested,
            "delivered": self.delivered,
            "lost_flagged": self.lost,
            "counted_by_envs": self.env_counted,
            "restarts_made": int(restarts.sum()),
            "max_restarts_one_env": int(restarts.max()) if restarts.size else 0,
            "steps_with_failures": len(self.flag_steps),
            "seconds_stepping": self.step_seconds,
            "steps_per_s": self.requested / self.step_seconds if self.step_seconds else 0.0,
            "median_step_ms": typical * 1e3,
            "hang_seconds_expected": sum(k == "hang" for k, *_ in events) * step_timeout,
            "median_extra_seconds_per_failure": {
                k: float(np.median(v)) for k, v in sorted(costs.items())
            },
            "flagged_obs_not_last": len(self.obs_mismatches),
            "flagged_obs_not_last_examples": self.obs_mismatches[:MAX_EXAMPLES],
            "flagged_field_errors": self.flag_field_errors,
            "anomalies": self.anomaly_count,
            "anomaly_examples": self.anomalies,
            "first_reset_ok": self.first_reset_ok,
            **self.reconcile(events),
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


TARGET = 0.9
"""The least throughput of the faulty pool, as a fraction of the fault-free one's."""


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


def soak_checks(faulty: dict[str, Any], clean: dict[str, Any]) -> dict[str, bool]:
    """The accounting checks; every one must hold."""
    out = {}
    for label, run in (("faulty", faulty), ("fault_free", clean)):
        for check, ok in {
            "delivered + lost == requested": (
                run["delivered"] + run["lost_flagged"] == run["requested"]
            ),
            "lost == restarts made": run["lost_flagged"] == run["restarts_made"],
            "every delivered result is the next call of its env": (
                run["anomalies"] == 0 and run["counted_by_envs"] == run["delivered"]
            ),
            "flagged results are truncated with reward 0": run["flagged_field_errors"] == 0,
            "flagged results carry the env's last observation": run["flagged_obs_not_last"] == 0,
            "flagged envs == those the injected failures account for": (
                run["steps_with_unexplained_flags"] == 0 and run["steps_with_missing_flags"] == 0
            ),
            "first reset": run["first_reset_ok"],
        }.items():
            out[f"{label}: {check}"] = ok
    out["fault_free: nothing flagged"] = clean["lost_flagged"] == 0
    return out


def run_soak(args: SoakConfig, json_path: Path) -> int:
    """Run the soak, print what it found, write it to ``json_path``; 0 when every check held,
    1 when one failed (2, from the watchdog, when a step stalled)."""
    machine = print_machine(Console(highlight=False))
    pool_steps = math.ceil(args.steps / args.num_envs)
    chunks = max(1, min(args.chunks, pool_steps))
    sizes = [len(c) for c in np.array_split(np.arange(pool_steps), chunks)]
    print(
        f"{args.num_envs} envs over {args.workers} workers, {pool_steps * args.num_envs:,} steps "
        f"per pool in {chunks} alternating chunks; p_fail={args.p_fail:g} per step "
        f"({', '.join(args.kinds)}), step_timeout={args.step_timeout:g} s, on_error=restart"
        + (f"; node sub-pools on a fake cluster of {args.nodes} nodes" if args.nodes else "")
    )
    started = time.perf_counter()
    with fake_cluster(args.nodes), tempfile.TemporaryDirectory(prefix="envfleet-soak-") as log_dir:
        runs: dict[str, SoakRun] = {}
        try:
            stall_s = args.stall_s or max(60.0, 40 * args.step_timeout)
            start_watchdog(runs, stall_s, {"machine": machine, "args": asdict(args)}, json_path)
            for name, p_fail in (("faulty", args.p_fail), ("fault_free", 0.0)):
                runs[name] = SoakRun(name, p_fail, args, log_dir)
            for k, size in enumerate(sizes):
                for run in list(runs.values())[:: -1 if k % 2 else 1]:
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
    faulty, clean = summaries["faulty"], summaries["fault_free"]
    checks = soak_checks(faulty, clean)
    for name, got in summaries.items():
        print(
            f"{name}: requested {got['requested']:,} = delivered {got['delivered']:,} "
            f"+ lost {got['lost_flagged']:,}; restarts {got['restarts_made']:,}; "
            f"{got['steps_per_s']:,.0f} steps/s (median step {got['median_step_ms']:.2f} ms)"
        )
    kinds = ", ".join(f"{k} {v}" for k, v in faulty["by_kind"].items())
    costs = ", ".join(
        f"{k} {v * 1e3:.0f} ms" for k, v in faulty["median_extra_seconds_per_failure"].items()
    )
    print(
        f"failures injected: {faulty['failures_injected']} ({kinds}); envs restarted: "
        f"{faulty['restarts_made']}; median extra time of a step with one failure: {costs}"
    )
    ratio = faulty["steps_per_s"] / clean["steps_per_s"]
    without = faulty["seconds_stepping"] - faulty["hang_seconds_expected"]
    no_hangs = faulty["requested"] / without / clean["steps_per_s"] if without > 0 else math.nan
    print(
        f"faulty / fault-free steps/s = {ratio:.3f} (target >= {TARGET}) "
        f"{'met' if ratio >= TARGET else 'missed'}; without the hang waits: {no_hangs:.3f}"
    )
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    wall = time.perf_counter() - started
    print(f"wall time {wall:.1f} s")
    config = {**asdict(args), "steps_per_pool": pool_steps * args.num_envs, "chunks": chunks}
    report = {
        "machine": machine,
        "config": config,
        "faulty": faulty,
        "fault_free": clean,
        "obs_columns": ["env_index", "pool_step", "calls", "episode_step", "episodes"],
        "ratio_faulty_over_fault_free": ratio,
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "checks": checks,
        "all_checks_passed": all(checks.values()),
        "wall_seconds": wall,
    }
    save_json(json_path, report)
    return 0 if all(checks.values()) else 1


QUICK = {"steps": 50_000, "p_fail": 1e-3, "chunks": 4}
"""``--quick``: fewer steps, and failures frequent enough to happen in them."""


def main(argv: list[str] | None = None) -> int:
    """An option per :class:`SoakConfig` field (``--p-fail``, ``--kinds raise,exit``, ...)."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in dataclasses.fields(SoakConfig):
        kind = float if f.name == "stall_s" else type(f.default)
        if f.name == "kinds":
            kind = lambda v: tuple(k for k in v.split(",") if k)  # noqa: E731
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, help=f"default {f.default}")
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK}")
    args = vars(parser.parse_args(argv))
    path, quick = args.pop("json"), args.pop("quick")
    given = {k: v for k, v in args.items() if v is not None}
    try:
        config = SoakConfig(**{**(QUICK if quick else {}), **given})
    except ValueError as exc:
        parser.error(str(exc))
    return run_soak(config, path)


if __name__ == "__main__":
    sys.exit(main())
