"""The benchmark engine's checking parts: the fault soak's accounting, the GIL probe and the
statistics on/off comparison."""

from __future__ import annotations

import json
from pathlib import Path

from envfleet.benchmark.soak import SoakConfig, run_soak, soak_checks

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
