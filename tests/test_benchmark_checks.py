"""The bench scripts' checking parts: the fault soak's accounting and stall report, the GIL
probe, the statistics on/off comparison and what the scripts share."""

from __future__ import annotations

import argparse
import functools
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

import envfleet
from bench.common import (
    Case,
    IdealRunner,
    Versus,
    add_choice,
    add_ratios,
    layouts,
    measure_cases,
    measure_table,
    own_sync_column,
    target,
)
from bench.envs import read_log
from bench.ray_bench import BatchActor
from bench.soak import SoakConfig, SoakRun, run_soak, soak_checks
from bench.stats_overhead import RECORDING, StatsSetup, stats_disabled, stats_overhead
from bench.thread_bench import (
    HOLDS,
    REFERENCES,
    RELEASES,
    main_thread_progress,
    open_bare_threads,
    scaling_cases,
    scaling_verdict,
)
from envfleet.benchmark import CallRunner, Runner, RunResult, Timing, Workload, open_envfleet
from envfleet.stats import StatsRecorder
from tests.envs import FaultyEnv

TIMING = Timing(seconds=0.05, warmup=0.02, rewarm=0.01, repeats=2)


def _counting(index: int) -> Callable[[], int]:
    return lambda: 1


SMALL_SOAK = SoakConfig(
    steps=8 * 150,
    p_fail=0.01,
    num_envs=8,
    workers=2,
    kinds=("raise", "exit"),
    episode_steps=40,
    chunks=2,
    step_timeout=5.0,
)


def test_soak_accounts_for_every_injected_failure(tmp_path: Path) -> None:
    path = tmp_path / "soak.json"
    assert run_soak(SMALL_SOAK, path) == 0
    report = json.loads(path.read_text())
    faulty, clean = report["faulty"], report["fault_free"]
    assert report["all_checks_passed"] and all(report["checks"].values())
    # p=0.01 per env step over 1200 steps: failures are certain (seeded: the same every run).
    assert faulty["failures_injected"] > 0
    assert set(faulty["by_kind"]) == {"raise", "exit", "hang"} and faulty["by_kind"]["hang"] == 0
    assert faulty["lost_flagged"] == faulty["restarts_made"] > 0
    assert faulty["delivered"] + faulty["lost_flagged"] == faulty["requested"] == 8 * 150
    assert clean["lost_flagged"] == clean["failures_injected"] == 0
    # A lost result counted as delivered breaks exactly the checks that read it.
    doctored = {**faulty, "delivered": faulty["delivered"] + 1}
    failed = [name for name, ok in soak_checks(doctored, clean).items() if not ok]
    assert failed == [
        "faulty: delivered + lost == requested",
        "faulty: every delivered result is the next call of its env",
    ]


def test_a_stalled_step_shows_in_the_soak_report(tmp_path: Path) -> None:
    # Every env hangs at its first step: each worker stops at its first env, and the step
    # waits for step_timeout. The report, taken meanwhile, must see the pool waiting.
    config = SoakConfig(
        steps=4, p_fail=1.0, num_envs=4, workers=2, kinds=("hang",), step_timeout=3.0, hang_s=30
    )
    run = SoakRun("stalled", config.p_fail, config, str(tmp_path))
    stepping = threading.Thread(target=run.advance, args=(1,))
    try:
        stepping.start()
        deadline = time.monotonic() + 10
        while len(read_log(run.log_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        report = run.diagnose()
        stepping.join(30)
    finally:
        run.close()
    assert report["step"] == 0
    assert report["pending_per_worker"] == [["Step(0, 1)"], ["Step(2, 3)"]]
    assert report["envs_in_flight"] == [0, 1, 2, 3] and report["envs_ready"] == []
    assert [(kind, env) for kind, env, *_ in report["last_failures"]] in (
        [("hang", 0), ("hang", 2)],
        [("hang", 2), ("hang", 0)],
    )
    pids = {e[3] for e in report["last_failures"]}
    assert pids <= {p["pid"] for p in report["child_processes"]}
    assert report["restarts"] == [0, 0, 0, 0]
    # The step then ends: the hung workers are killed and their envs restarted.
    assert not stepping.is_alive() and run.lost == 4


def test_stats_disabled_records_nothing_and_puts_the_recorder_back() -> None:
    recording = {name: StatsRecorder.__dict__[name] for name in RECORDING}
    with envfleet.make("CartPole-v1", 4, backend="serial", seed=0) as pool:
        pool.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        with stats_disabled():
            for _ in range(5):
                pool.step(actions)
        assert pool.stats().steps == 0
        for _ in range(3):
            pool.step(actions)
        assert pool.stats().steps == 3 * 4
    assert {name: StatsRecorder.__dict__[name] for name in RECORDING} == recording


def test_stats_overhead_pairs_its_windows_and_counts_only_the_recorded_side() -> None:
    setup = StatsSetup(num_envs=4, backend="serial", seconds=0.02, rewarm=0.01, repeats=3)
    report = stats_overhead(setup)
    assert len(report["steps_per_s"]["stats_on"]) == len(report["steps_per_s"]["stats_off"]) == 3
    assert len(report["throughput_overhead_percent_pairs"]) == 3
    assert all(rate > 0 for side in report["steps_per_s"].values() for rate in side)
    # The warm-up and the windows with stats on, nothing else, reached the pool's statistics.
    assert report["steps_recorded_by_the_pool"] == report["steps_recorded_with_stats_on"]
    assert report["recording_us_per_vector_step"]["alone"] >= 0.0


# -- threads and the GIL ---------------------------------------------------------------------


def test_gil_probe_tells_a_call_that_holds_the_gil_from_one_that_releases_it() -> None:
    # A C loop that never lets go (sum over a range) against time.sleep: the main loop gets
    # only the gaps between calls in the first case, the whole time in the second.
    # Best of alternating windows: other load only ever slows a window down.
    holds, releases = REFERENCES[HOLDS](), REFERENCES[RELEASES]()
    rates = [
        (main_thread_progress(holds, 0.1), main_thread_progress(releases, 0.1)) for _ in "abcd"
    ]
    assert max(h for h, _ in rates) < 0.7 * max(r for _, r in rates)


@pytest.mark.parametrize(
    ("threads", "processes", "reading"),
    [
        (None, 1.9, "not measured"),
        (1.9, 1.1, "scaling inconclusive"),
        (1.8, 1.9, "threads scale like processes"),
        (1.0, 1.9, "threads do not scale"),
        (1.3, 1.9, "threads scale partly"),
    ],
)
def test_scaling_verdict(threads: float | None, processes: float, reading: str) -> None:
    assert scaling_verdict(threads, processes).startswith(reading)


STEPPED: list[tuple[int, int]] = []


def _record(env: FaultyEnv, action: Any) -> None:
    STEPPED.append((id(env), threading.get_ident()))


def test_bare_threads_make_one_env_step_per_env_off_the_callers_thread() -> None:
    STEPPED.clear()
    workload = Workload.of(functools.partial(FaultyEnv, step_hook=_record), 4)
    runner = open_bare_threads(workload, TIMING)
    try:
        for _ in range(3):
            before = len(STEPPED)
            assert runner.advance() == 4  # type: ignore[attr-defined]
            last = STEPPED[before:]
            assert len(last) == 4  # steps counted are steps made, no more, no fewer
            assert threading.get_ident() not in {thread for _, thread in last}
            assert all(thread != env for env, thread in last)
    finally:
        runner.close()


def test_scaling_cases_sum_their_workers() -> None:
    cases = scaling_cases("count", _counting)
    assert [c.name for c in cases] == ["count: 1 thread", "count: 2 threads", "count: 2 processes"]
    assert [c.forks for c in cases] == [False, False, True]
    results = measure_cases(cases[:2], Workload.of("CartPole-v1", 1), TIMING)
    assert all(isinstance(r, RunResult) and r.median > 0 for r in results.values())
    assert results["count: 2 threads"].info == {"mode": "thread"}  # type: ignore[union-attr]


# -- what the scripts share ------------------------------------------------------------------


def test_layouts_pair_each_async_row_with_its_sync_row() -> None:
    cases = layouts("pool", (8, 4), _opener, forks=True, backend="thread")
    assert [(c.name, c.sync_of, c.forks) for c in cases] == [
        ("pool sync", None, True),
        ("pool B=8", "pool sync", True),
        ("pool B=4", "pool sync", True),
    ]
    assert cases[1].open.keywords == {"batch_size": 8, "backend": "thread"}  # type: ignore[attr-defined]
    results: dict[str, RunResult | str] = {
        "pool sync": RunResult("pool sync", [100.0], 0.0),
        "pool B=8": RunResult("pool B=8", [150.0, 250.0, 200.0], 0.0),
        "pool B=4": "RuntimeError: no",
    }
    header, cell = own_sync_column(cases, results)
    assert header == "vs own sync"
    assert cell("pool sync", results["pool sync"]) == "1.00"  # type: ignore[arg-type]
    assert cell("pool B=8", results["pool B=8"]) == "2.00"  # type: ignore[arg-type]
    rows: dict[str, Any] = {"pool sync": {"steps_per_s": 100.0}, "pool B=4": {"error": "no"}}
    add_ratios(rows, "over", 50.0)
    assert rows == {"pool sync": {"steps_per_s": 100.0, "over": 2.0}, "pool B=4": {"error": "no"}}


def _opener(workload: Workload, timing: Timing, **kw: Any) -> Runner:
    raise AssertionError("not opened")


def test_target_and_choices() -> None:
    console = Console(file=io.StringIO())
    assert target(console, "a / b", 1.2, 1.0)["met"] is True
    assert target(console, "a / b", 0.8, 1.0)["met"] is False
    assert target(console, "a / b", None, 1.0)["met"] is None
    parser = argparse.ArgumentParser()
    add_choice(parser, "--parts", ["sleep", "gil", "pong"])
    assert parser.parse_args([]).parts == ["sleep", "gil", "pong"]
    assert parser.parse_args(["--parts", "pong, gil"]).parts == ["pong", "gil"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--parts", "sleep,nap"])


def test_ideal_runner_bounds_the_sync_ideal_by_the_mean_step() -> None:
    runner = IdealRunner(Workload.of(functools.partial(FaultyEnv, sleep=0.001), 8), TIMING)
    try:
        rate = runner.window(0.1)
    finally:
        runner.close()
    mean_s = runner.info["mean_step_ms"] / 1e3
    assert mean_s >= 0.001
    # The mean is the timed window's: its steps fit in the window, with the clock around them.
    assert rate <= 8 / mean_s * (1 + 1e-9)
    # The slowest of 8 steps is, on average, no faster than the mean step.
    assert runner.info["ideal_sync_steps_per_s"] <= 8 / mean_s * (1 + 1e-9)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_open_envfleet_steps_sync_or_by_batch(batch_size: int | None) -> None:
    workload = Workload.of(FaultyEnv, 4)
    runner = open_envfleet(workload, TIMING, batch_size=batch_size, backend="serial")
    try:
        assert runner.info["batch_size"] == (batch_size or 4)
        assert runner.window(0.05) > 0
    finally:
        runner.close()


def test_hand_batched_ray_actor_steps_its_envs_as_envs_stepped_one_by_one() -> None:
    spec = Workload.of("CartPole-v1", 2).spec
    actor = BatchActor(spec, [3, 4])
    envs = [spec.build() for _ in range(2)]
    for env, seed in zip(envs, [3, 4], strict=True):
        env.reset(seed=seed)
    for step in range(30):  # CartPole episodes end within 30 steps of alternating pushes
        actions = np.array([step % 2, (step + 1) % 2])
        obs, rewards, terminated, truncated = actor.step(actions)
        for i, env in enumerate(envs):
            want, reward, term, trunc, _ = env.step(int(actions[i]))
            if term or trunc:
                want, _ = env.reset()
            np.testing.assert_array_equal(obs[i], want)
            assert (rewards[i], terminated[i], truncated[i]) == (reward, term, trunc)


def _steady(steps: int) -> Callable[[Workload, Timing], Runner]:
    def open_(workload: Workload, timing: Timing) -> Runner:
        def advance() -> int:
            time.sleep(0.001)
            return steps

        return CallRunner(f"x{steps}", advance, lambda: None, timing)

    return open_


def _refuses(workload: Workload, timing: Timing) -> Runner:
    raise RuntimeError("no runner here")


def test_measure_table_adds_its_ratio_columns_to_the_json() -> None:
    cases = [Case("one", _steady(1)), Case("three", _steady(3)), Case("broken", _refuses)]
    out = io.StringIO()
    console = Console(file=out, width=200)
    columns = [Versus("vs one", "one", "ratio_to_one"), Versus("vs none", "absent")]
    results, rows = measure_table(console, "t", cases, Workload.of(FaultyEnv, 1), TIMING, columns)
    assert set(results) == set(rows) == {"one", "three", "broken"}
    assert rows["one"]["ratio_to_one"] == 1.0
    assert 1.2 < rows["three"]["ratio_to_one"] < 8.0  # 3 steps a call, the same sleep: about 3
    assert rows["broken"] == {"error": "RuntimeError: no runner here"}
    assert "vs none" in out.getvalue()


def test_waiting_sets_the_spin_of_workers_that_do_not_inherit_it() -> None:
    # Under spawn a worker imports the process backend afresh: a setting made in this process
    # alone would not reach it. Each worker sets its own while it builds its envs.
    from bench.waiting import SpinSetting

    factory = functools.partial(SpinSetting, Workload.of(FaultyEnv, 1).spec, 0.002)
    with envfleet.make(factory, 2, backend="process", num_workers=2, context="spawn") as pool:
        assert pool.get_attr("worker_spin_seconds") == (0.002, 0.002)
    from envfleet.backends import process

    assert process.SPIN_SECONDS == 0.0  # this process's own is untouched
