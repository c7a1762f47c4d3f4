"""The command line's edges a newcomer meets first: help printed once, ``bench --quick`` and its
first progress line at once, ``tune`` saying how many layouts it timed, durations in units that
read, backend names in any case, ``print(pool.stats())`` readable, the examples' ``--help``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import envfleet
from envfleet import benchmark
from envfleet.cli import bench as cli_bench
from envfleet.cli import build_parser
from envfleet.cli import tune as cli_tune
from envfleet.cli.layout_timing import LayoutTiming
from envfleet.cli.tune import human_seconds, suggested_budget
from envfleet.stats import NodeStats, PoolStats, WorkerStats
from envfleet.tune import Layout
from tests.test_cli import ENV, ROOT, run_cli


def envfleet_command(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python -m envfleet ARGV``, as the console script runs it."""
    return subprocess.run(
        [sys.executable, "-m", "envfleet", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"},
        timeout=90,
        check=False,
    )


@pytest.mark.parametrize("command", ["run", "bench", "tune"])
def test_help_is_printed_once(command: str) -> None:
    result = envfleet_command(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"usage: envfleet {command}") == 1, result.stdout
    assert result.stderr == ""


# -- backend names ------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["Process", "SERIAL", "thread"])
def test_run_takes_backend_names_in_any_case_as_make_does(given: str) -> None:
    args = build_parser().parse_args(["run", ENV, "--backend", given])
    assert args.backend == given.lower()
    with envfleet.make(
        ENV, num_envs=2, backend=given, num_workers=1 if given != "thread" else None
    ) as pool:
        assert pool.reset(seed=0)[0].shape == (2, 4)


def test_run_still_refuses_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "run", ENV, "--backend", "Proccess")
    assert status == 2
    assert "invalid choice: 'proccess'" in err and "process" in err


# -- bench --quick and its first line -----------------------------------------------------------


def test_bench_quick_fills_in_a_short_run_and_what_is_given_wins() -> None:
    parser = build_parser()
    quick = parser.parse_args(["bench", ENV, "--quick"])
    cli_bench.fill_defaults(quick)
    assert quick.num_envs == list(cli_bench.QUICK_NUM_ENVS)
    assert quick.runners == list(cli_bench.QUICK_RUNNERS)
    assert set(quick.runners) <= set(benchmark.RUNNERS)  # no peer library to import
    assert (quick.seconds, quick.repeats) == (cli_bench.QUICK_SECONDS, cli_bench.QUICK_REPEATS)

    given = parser.parse_args(["bench", ENV, "--quick", "--num-envs", "2,4", "--repeats", "2"])
    cli_bench.fill_defaults(given)
    assert (given.num_envs, given.repeats) == ([2, 4], 2)

    full = parser.parse_args(["bench", ENV])
    cli_bench.fill_defaults(full)
    assert full.num_envs == list(cli_bench.DEFAULT_BENCH_NUM_ENVS)
    assert full.runners is None  # all of them
    assert (full.seconds, full.repeats) == (
        cli_bench.DEFAULT_BENCH_SECONDS,
        cli_bench.DEFAULT_BENCH_REPEATS,
    )


class Stop(Exception):
    pass


def test_bench_says_what_it_does_before_importing_the_peer_libraries(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runners' availability imports SB3 (torch), Ray...: seconds of a blank terminal
    unless a line comes first."""
    said_before: list[str] = []

    def availability(name: str, spec: Any) -> Any:
        said_before.append(capsys.readouterr().err)
        raise Stop

    monkeypatch.setattr(benchmark, "availability", availability)
    status, _, err = run_cli(capsys, "bench", ENV, "--quick", "--out", str(tmp_path / "out"))
    assert status == 1 and "Stop" in err
    assert said_before and f"{ENV}: checking which of 4 runners can run here" in said_before[0]


def test_bench_quick_runs_and_writes_its_results(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = run_cli(
        capsys, "bench", ENV, "--quick", "--runners", "loop,process", "--out", str(tmp_path)
    )
    assert status == 0, err
    assert err.splitlines()[0] == f"{ENV}: checking which of 2 runners can run here"
    assert "8 envs" in out
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.png").is_file()


# -- tune ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.6019445, "602 ms"),
        (601.9445e-6, "602 µs"),
        (42.5e-6, "42.5 µs"),
        (3.2e-3, "3.2 ms"),
        (1.25, "1.25 s"),
        (250e-9, "250 ns"),
    ],
)
def test_durations_read_in_their_unit(seconds: float, shown: str) -> None:
    assert human_seconds(seconds) == shown


def test_the_suggested_budget_leaves_time_for_every_layout() -> None:
    assert suggested_budget(20.0, 20.5, 1, 6) == 125.0  # 20.5 s a layout, 6 layouts, up to 5
    assert suggested_budget(20.0, 18.0, 2, 6) == 60.0  # the budget, not less, was spent
    assert suggested_budget(1.0, 1.0, 3, 4) == 5.0


def test_tune_says_how_many_layouts_it_timed_and_suggests_a_budget(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    layouts = [Layout(envfleet.Backend.PROCESS, w, 1, None) for w in (1, 2)] + [
        Layout(envfleet.Backend.SERIAL, 1, 1, None)
    ]
    real = cli_tune.tune_layouts

    def tune_layouts(spec: Any, num_envs: int, budget: float, **kwargs: Any) -> Any:
        profile, _ = real(spec, num_envs, 1.0, **kwargs)
        timed = LayoutTiming(layouts[0], 0.5, steps_per_second=1234.5, steps_per_env=50.0)
        skipped = [LayoutTiming(layout, 0.0, skipped="budget spent") for layout in layouts[1:]]
        return profile, [timed, *skipped]

    monkeypatch.setattr(cli_tune, "tune_layouts", tune_layouts)
    status, out, err = run_cli(capsys, "tune", ENV, "--num-envs", "2", "--budget", "1")
    assert status == 0, err
    lines = out.strip().splitlines()
    assert re.search(r"timed 1 of 3 layouts before the 1 s budget was spent", lines[-3])
    assert re.search(r"--budget \d+", lines[-3])
    assert lines[-2].startswith("best: process, 1 worker: 1,234 steps/s (1 of 3 layouts timed")
    assert lines[-1].startswith("envfleet.make(")
    assert not re.search(r"\d{3},\d{3}\.\d µs", out)  # no six-figure microseconds

    status, out, err = run_cli(capsys, "tune", ENV, "--num-envs", "2", "--budget", "1", "--json")
    assert status == 0, err

    document = json.loads(out)
    assert (document["timed_layouts"], document["candidate_layouts"]) == (1, 3)
    assert document["suggested_budget_s"] >= 5


# -- stats --------------------------------------------------------------------------------------


def test_print_of_the_pool_stats_is_readable_and_rounded() -> None:
    worker = WorkerStats(0, (0, 1, 2, 3), 0.4123456, 1.98765, 0.123456, 4000, 12, 1)
    node = NodeStats("abcdef0123456789", "10.0.0.2", 2, 4, 100, 100, 5000, 7000, 1.23456)
    stats = PoolStats(2.34567, 4000, 12, 1, (worker,), nodes=(node,))
    text = str(stats)
    assert "PoolStats(" not in text and "WorkerStats(" not in text
    assert text.splitlines() == [
        "4,000 steps in 2.3 s (1,705/s), 12 episodes, 1 restarts",
        "  worker 0 (envs 0-3): latency p50 0.412 ms, p99 1.99 ms, idle 12%, 4,000 steps, "
        "12 episodes, 1 restarts",
        "  node abcdef01 (10.0.0.2): 4 envs on 2 workers, 100 messages, round trip 1.23 ms, "
        "12,000 bytes",
    ]
    assert "(env 5)" in str(WorkerStats(1, (5,), None, None, 1.0, 0, 0, 0))
    assert "p50 -" in str(WorkerStats(1, (5,), None, None, 1.0, 0, 0, 0))


def test_a_pools_stats_print_one_line_per_worker() -> None:
    with envfleet.make(ENV, num_envs=4, backend="serial", seed=0) as pool:
        pool.reset()
        for _ in range(5):
            pool.step(pool.action_space.sample())
        lines = str(pool.stats()).splitlines()
    assert len(lines) == 2
    assert re.match(r"20 steps in \d+\.\d s \(", lines[0])
    assert lines[1].startswith("  worker 0 (envs 0-3): latency p50 ")


# -- the examples' --help -----------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "example", ["ppo_cartpole.py", "ppo_atari_async.py", "atari_rollout.py", "seed_simulator.py"]
)
def test_every_option_of_an_example_says_what_it_is(example: str) -> None:
    result = subprocess.run(
        [sys.executable, example, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT / "examples",
        env={**os.environ, "COLUMNS": "1000"},  # one line per option
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    options: list[str] = []  # each option's lines joined: flag, metavar, help
    for line in result.stdout.split("options:")[1].splitlines():
        if line.startswith("  -"):
            options.append(line.strip())
        elif line.startswith("   ") and options:
            options[-1] += "  " + line.strip()
    assert len(options) >= 4
    for line in options:
        flag, _, text = line.partition("  ")
        assert text.strip(), f"{example}: {flag} has no help"
    # Every option with a value shows its default (or says what it is when unset).
    for line in options:
        if re.match(r"--[\w-]+ [A-Z_]+\s", line):
            assert "default" in line, f"{example}: {line}"
