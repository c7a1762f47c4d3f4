"""The benchmark engine's checking parts: the fault soak's accounting, the GIL probe and the
statistics on/off comparison."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import envfleet
from envfleet.benchmark.soak import SoakConfig, run_soak, soak_checks
from envfleet.benchmark.stats_cost import RECORDING, StatsSetup, stats_disabled, stats_overhead
from envfleet.stats import StatsRecorder

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
