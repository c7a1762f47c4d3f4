"""The benchmark engine's own runners (the bare pool, the ceiling, ale-py's vector env),
a script's cases, the sweep's progress and the plot's notes."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from bench.common import script_parser, timing_from
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark.bare import BareNodePool
from envfleet.spec import EnvSpec
from tests.envs import FaultyEnv

TIMING = benchmark.Timing(seconds=0.05, warmup=0.02, rewarm=0.01, repeats=2)


def _broken() -> FaultyEnv:
    raise OSError("no simulator here")


def test_bare_pool_steps_every_env_on_the_process_backend_layout() -> None:
    workload = benchmark.Workload.of(FaultyEnv, 3)
    results = benchmark.measure([benchmark.BARE_POOL], workload, TIMING)
    result = results[benchmark.BARE_POOL]
    assert isinstance(result, benchmark.RunResult)
    assert len(result.throughputs) == 2 and min(result.throughputs) > 0
    assert result.info == {"workers": min(len(usable_cpus()), 3)}


def test_bare_pool_worker_that_cannot_build_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="bare-pool worker died"):
        benchmark.open_bare_pool(benchmark.Workload.of(_broken, 2), TIMING, num_workers=2)


class _Logged(FaultyEnv):
    """Writes its reset seed and its process to ``path`` at every step."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def step(self, action: Any) -> Any:
        with open(self.path, "a") as log:
            log.write(f"{self.seed_used} {os.getpid()}\n")
        return super().step(action)


def test_bare_node_pool_steps_every_env_once_a_step_on_its_layout(tmp_path: Path) -> None:
    path = tmp_path / "steps"
    workload = benchmark.Workload.of(_Logged, 10, {"path": str(path)})
    pool = BareNodePool(workload, TIMING, nodes=2, workers_per_node=2)
    pool_pids = {role: list(pids) for role, pids in pool.pids.items()}
    procs = [psutil.Process(pid) for pids in pool_pids.values() for pid in pids]
    try:
        assert pool.layout == [2, 2]
        for _ in range(3):
            pool.step()
    finally:
        pool.close()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    steps = [line.split() for line in path.read_text().splitlines()]
    assert Counter(seed for seed, _ in steps) == {str(TIMING.seed + i): 3 for i in range(10)}
    by_process: dict[str, set[int]] = {}
    for seed, pid in steps:
        by_process.setdefault(pid, set()).add(int(seed) - TIMING.seed)
    # 4 workers (2 nodes x 2), each a consecutive block of the envs, as np.array_split makes them
    assert sorted(map(sorted, by_process.values())) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert len(pool_pids["agents"]) == 2
    assert sorted(pool_pids["workers"]) == sorted(int(pid) for pid in by_process)


def test_bare_node_pool_worker_that_cannot_build_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="bare-nodes worker or agent died"):
        benchmark.open_bare_nodes(benchmark.Workload.of(_broken, 4), TIMING, 2, 2)
    with pytest.raises(ValueError, match="workers_per_node must be >= 1"):
        benchmark.open_bare_nodes(benchmark.Workload.of(FaultyEnv, 4), TIMING, 2, 0)


def test_ceiling_splits_the_envs_over_processes_and_reports_a_failure() -> None:
    workload = benchmark.Workload.of(FaultyEnv, 3)
    runner = benchmark.CeilingRunner(workload, TIMING)
    try:
        assert runner.window(0.05) > 0
    finally:
        runner.close()
    processes = min(len(usable_cpus()), 3)
    assert runner.info["processes"] == processes and sum(runner.info["envs_per_process"]) == 3
    with pytest.raises(RuntimeError, match="ceiling worker failed: OSError: no simulator here"):
        benchmark.CeilingRunner(benchmark.Workload.of(_broken, 2), TIMING)


def _call_runner(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
    return benchmark.CallRunner("calls", lambda: 4, lambda: None, timing, answer=42)


def _refuses(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
    raise ValueError("not here")


def test_a_scripts_runners_go_through_measure_beside_registered_ones() -> None:
    openers = {"calls": _call_runner, "refuses": _refuses}
    workload = benchmark.Workload.of(FaultyEnv, 2)
    results = benchmark.measure(["calls", "refuses", "loop"], workload, TIMING, openers=openers)
    assert list(results) == ["calls", "refuses", "loop"]
    assert results["refuses"] == "ValueError: not here"
    calls = results["calls"]
    assert isinstance(calls, benchmark.RunResult)
    assert calls.info == {"answer": 42} and len(calls.throughputs) == TIMING.repeats
    assert calls.setup_s >= 0  # a runner that does not time its start-up: the engine does
    assert isinstance(results["loop"], benchmark.RunResult)
    report = benchmark.sweep(FaultyEnv, [2], ["calls", "loop"], TIMING, openers=openers)
    assert report.status("calls") == benchmark.OK
    assert "description" not in report.as_dict()["runners"]["calls"]


def test_ale_vector_steps_the_frames_of_the_gymnasium_ale_env() -> None:
    # Sticky actions off, so that both are deterministic given the seed: frame for frame.
    spec = EnvSpec.from_user("ALE/Pong-v5", {"repeat_action_probability": 0.0})
    options = benchmark.ale_vector_options(spec)
    assert options is not None and options["frameskip"] == 4
    assert (
        benchmark.ale_vector_options(EnvSpec.from_user("ALE/Pong-v5"))["repeat_action_probability"]
        == 0.25
    )  # type: ignore[index]
    assert benchmark.ale_vector_options(EnvSpec.from_user("CartPole-v1")) is None
    assert (
        benchmark.ale_vector_options(EnvSpec.from_user("ALE/Pong-v5", {"obs_type": "ram"})) is None
    )
    from ale_py.vector_env import AtariVectorEnv

    game = options.pop("game")
    vec, env = AtariVectorEnv(game, 1, num_threads=1, **options), spec.build()
    try:
        frames, _ = vec.reset(seed=3)
        frame, _ = env.reset(seed=3)
        np.testing.assert_array_equal(frames[0, 0], frame)
        for action in np.random.default_rng(0).integers(0, 6, size=100).tolist():
            frames, rewards, *_ = vec.step(np.array([action]))
            frame, reward, *_ = env.step(action)
            np.testing.assert_array_equal(frames[0, 0], frame)
            assert rewards[0] == reward
    finally:
        vec.close()
        env.close()


def test_sweep_reports_each_stage_with_its_place_and_the_share_done() -> None:
    stages: list[str] = []
    shown: list[str] = []
    report = benchmark.sweep(
        FaultyEnv, [1, 2], ["loop", "serial"], TIMING, progress=shown.append,
        on_stage=stages.append,
    )  # fmt: skip
    assert report.status("loop") == report.status("serial") == benchmark.OK
    assert [s.split("] ", 1)[1] for s in stages] == [
        "FaultyEnv x 1 (1 of 2): starting loop (1 of 2)",
        "FaultyEnv x 1 (1 of 2): starting serial (2 of 2)",
        "FaultyEnv x 2 (2 of 2): starting loop (1 of 2)",
        "FaultyEnv x 2 (2 of 2): starting serial (2 of 2)",
    ]
    # One progress line per opening and per window: 2 counts x 2 runners x (1 + 2 windows).
    assert len(shown) == 12 and shown[-1].endswith(", window 2/2")
    shares = [int(line[1 : line.index("%")]) for line in shown]
    assert shares == sorted(shares) and shares[0] == 0 and shares[-1] == round(100 * 11 / 12)
    assert all(", ETA " in line for line in shown[1:])


def test_the_plot_names_what_was_skipped_or_failed_and_the_skew() -> None:
    ok = {n: benchmark.Availability(benchmark.OK) for n in ("loop", "process")}
    report = benchmark.Report("env", [2, 4], ["loop", "process"], TIMING, ok)
    report.results = {
        "loop": {2: benchmark.RunResult("loop", [10.0], 0.1, other_load=[0.8]),
                 4: benchmark.Skipped("start-up over 3 s, skipped")},
        "process": {2: "RuntimeError: no", 4: benchmark.RunResult("process", [20.0], 0.1)},
    }  # fmt: skip
    assert benchmark.plot_label(report, "loop") == "loop (skipped at 4)"
    assert benchmark.plot_label(report, "process") == "process (failed at 2)"
    notes = benchmark.report_notes(report)
    assert any("0.80 cores busy" in note and "skewed" in note for note in notes)


def test_every_bench_script_takes_quick() -> None:
    root = Path(__file__).resolve().parent.parent
    scripts = {p.name: p.read_text() for p in (root / "bench").glob("*.py")}
    scripts = {name: text for name, text in scripts.items() if "__main__" in text}
    assert len(scripts) >= 10
    # The shared parser's --quick, or an option of the script's own.
    assert {
        n for n, t in scripts.items() if "script_parser(" not in t and '"--quick"' not in t
    } == set()
    args = script_parser("doc", Path("x.json")).parse_args(["--quick"])
    assert timing_from(args) == benchmark.Timing(seconds=0.5, warmup=0.3, rewarm=0.1, repeats=1)
    args = script_parser("doc", Path("x.json")).parse_args(["--quick", "--repeats", "2"])
    assert timing_from(args).repeats == 2 and timing_from(args, full=(1.0, 5)).seconds == 0.5
