"""The bench scripts' checking parts: the fault soak's accounting and stall report, bare threads,
hand-batched Ray actors and what the scripts share."""

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

from bench.common import Case, add_choice, measure_table, target
from bench.envs import read_log
from bench.soak import SoakConfig, SoakRun, run_soak, soak_checks
from bench.throughput import BatchActor
from envfleet.benchmark import (
    CallRunner,
    Runner,
    RunResult,
    Timing,
    Workload,
    open_bare_threads,
    open_envfleet,
)
from tests.envs import FaultyEnv

TIMING = Timing(seconds=0.05, warmup=0.02, rewarm=0.01, repeats=2)


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


# -- threads --------------------------------------------------------------------------------


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


def test_measure_table_shows_the_rows_in_order_with_their_ratios_and_failures() -> None:
    opened: list[str] = []

    def noting(name: str, opener: Any) -> Any:
        return lambda w, t: opened.append(name) or opener(w, t)

    cases = [
        Case("one", noting("one", _steady(1))),
        Case("three", noting("three", _steady(3))),
        Case("broken", noting("broken", _refuses)),
    ]
    out = io.StringIO()
    console = Console(file=out, width=200)
    report = measure_table(console, "t", cases, Workload.of(FaultyEnv, 1), TIMING, "one")
    assert opened == ["one", "three", "broken"]
    assert report.runners == ["one", "three", "broken"]  # shown in the order given
    assert report.ratio("one", 1, "one") == 1.0
    assert 1.2 < report.ratio("three", 1, "one") < 8.0  # type: ignore[operator]
    assert report.results["broken"][1] == "RuntimeError: no runner here"
    setup = report.results["one"][1]
    assert isinstance(setup, RunResult) and setup.setup_s >= 0  # timed by the engine
    text = out.getvalue()
    assert "/one" in text and "failed" in text and "broken failed" in text
