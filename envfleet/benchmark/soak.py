"""The fault-tolerance soak: pools of envs that raise, exit or hang at random, every step
accounted for.

:func:`run_soak` steps two pools of :class:`~envfleet.benchmark.soak_env.SoakEnv` side by side
in one process, in alternating chunks (so that load from elsewhere hits both alike): one whose
envs fail with probability ``p_fail`` per step (raise, ``os._exit`` their worker, or hang until
``step_timeout`` kills it) and a fault-free one, both with ``on_error="restart"``. A
:class:`SoakRun` checks each result as it comes, step by step:

- every result is either delivered or flagged ``infos["envfleet/restarted"]`` (lost), and
  ``delivered + lost == requested``; ``lost == sum(pool.restarts)``;
- a delivered result is the next call of its env instance (its counter advanced by exactly 1,
  the action's step id echoed; after an episode end or a restart, a reset): no step silently
  lost, repeated or given to the wrong env;
- a flagged result has reward 0, ``truncated``, and the env's last observation (or, for an env
  of a dead or hung worker that finished its step before the failure, that step's);
- the flagged envs of each step are exactly those the injected failures account for.

:func:`soak_checks` turns two summaries into named checks; a ``pool.step`` that stalls past
``stall_s`` ends the process with status 2 after printing the pool's state (a watchdog).
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from envfleet.benchmark.cases import fmt, save_json
from envfleet.benchmark.measure import machine_info
from envfleet.benchmark.soak_check import SoakConfig, SoakRun
from envfleet.benchmark.soak_env import OBS_SIZE

__all__ = ["TARGET", "SoakConfig", "SoakRun", "run_soak", "soak_checks", "start_watchdog"]

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


def run_soak(args: SoakConfig, json_path: Path) -> int:
    """Run the soak, print what it found, write it to ``json_path``; 0 when every check held,
    1 when one failed (2, from the watchdog, when a step stalled)."""
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
            start_watchdog(runs, stall_s, {"machine": machine, "args": asdict(args)}, json_path)
            runs["faulty"] = SoakRun("faulty", args.p_fail, args, log_dir)
            if args.baseline:
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
    results = soak_checks(faulty, clean) if clean else {}
    print()
    for name, got in summaries.items():
        print(
            f"{name}: requested {got['requested']:,} = delivered {got['delivered']:,} "
            f"+ lost {got['lost_flagged']:,}; restarts {got['restarts_made']:,}; "
            f"{got['steps_per_s']:,.0f} steps/s (median step {got['median_step_ms']:.2f} ms)"
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
    if ratio is not None and clean is not None:
        verdict = ratio >= TARGET
        without = faulty["seconds_stepping"] - faulty["hang_seconds_expected"]
        ratio_no_hangs = faulty["requested"] / without / clean["steps_per_s"] if without else None
        print(
            f"faulty / fault-free steps/s = {ratio:.3f} (target >= {TARGET}) "
            f"{'met' if verdict else 'missed'}; without the hang waits: "
            f"{fmt(ratio_no_hangs, '.3f')}"
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
            "kinds": list(args.kinds),
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
    save_json(json_path, report)
    return 1 if failed else 0
