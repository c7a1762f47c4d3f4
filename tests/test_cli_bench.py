"""``envfleet bench`` and ``envfleet run --stats``, run for real on CartPole-v1, small numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib.image
import psutil
import pytest

from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.spec import EnvSpec
from tests.test_cli import ENV, run_cli, run_subprocess

TINY = ["--seconds", "0.2", "--repeats", "1"]
RUNNERS = ["loop", "serial", "process", "gym-sync"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "bench", ENV, *TINY, "--out", str(out), *argv)


def check_png(path: Path) -> None:
    assert path.read_bytes().startswith(PNG_MAGIC)
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


# -- bench ---------------------------------------------------------------------------------------


def test_bench_writes_png_and_json_with_the_runners_asked_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "results"  # made by the command
    status, stdout, err = bench(
        capsys, out, "--num-envs", "2,4", "--runners", ",".join(RUNNERS), "--json"
    )
    assert status == 0, err
    document: dict[str, Any] = json.loads(stdout)  # stdout holds the JSON and nothing else
    assert json.loads((out / "bench.json").read_text()) == document
    check_png(out / "bench.png")
    assert document["files"] == {"json": str(out / "bench.json"), "png": str(out / "bench.png")}

    assert document["env"] == ENV
    assert document["num_envs"] == [2, 4]
    assert list(document["runners"]) == RUNNERS  # exactly those, in order
    assert document["not_installed"] == []
    assert document["interrupted"] is False
    assert document["timing"]["seconds"] == 0.2
    assert document["timing"]["repeats"] == 1
    assert document["machine"]["usable_cores"] >= 1
    loop = {p["num_envs"]: p["steps_per_s"] for p in document["runners"]["loop"]["results"]}
    for name, entry in document["runners"].items():
        assert entry["status"] == "ok", (name, entry)
        assert [point["num_envs"] for point in entry["results"]] == [2, 4]
        for point in entry["results"]:
            assert point["steps_per_s"] > 0, (name, point)
            assert point["windows"] == [point["steps_per_s"]]
            assert point["setup_s"] >= 0
            assert point["ratio_to_ceiling"] is None  # no ceiling asked for
            ratio = point["steps_per_s"] / loop[point["num_envs"]]
            assert point["ratio_to_loop"] == pytest.approx(ratio)
    process = document["runners"]["process"]["results"]
    assert [p["info"]["workers"] for p in process] == [min(len(usable_cpus()), n) for n in (2, 4)]


def test_bench_table_ceiling_ratio_and_not_installed_runner(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = benchmark.RunnerKind(
        "missing", "a peer that is not installed", benchmark.open_loop, "envfleet_no_such_peer"
    )
    monkeypatch.setitem(benchmark.RUNNERS, "missing", missing)
    status, stdout, err = bench(
        capsys, tmp_path, "--num-envs", "2", "--runners", "loop,ceiling,missing"
    )
    assert status == 0, err
    main, startup = stdout.split("start-up, seconds to build and reset the envs")
    rows = {line.split()[1]: line for line in main.splitlines() if line.startswith("│")}
    assert set(rows) == {"loop", "ceiling"}  # the missing runner has no row
    assert {line.split()[1] for line in startup.splitlines() if line.startswith("│")} == set(rows)
    assert "1.00" in rows["ceiling"]  # the ceiling's ratio to itself
    assert "skipped: missing (envfleet_no_such_peer is not installed)" in stdout
    assert f"results written to {tmp_path / 'bench.json'}" in stdout

    document = json.loads((tmp_path / "bench.json").read_text())
    assert list(document["runners"]) == ["loop", "ceiling", "missing"]
    assert document["not_installed"] == ["missing"]
    assert document["runners"]["missing"]["status"] == "not installed"
    assert "results" not in document["runners"]["missing"]
    (loop,) = document["runners"]["loop"]["results"]
    (ceiling,) = document["runners"]["ceiling"]["results"]
    assert ceiling["ratio_to_ceiling"] == 1.0
    assert loop["ratio_to_ceiling"] == pytest.approx(loop["steps_per_s"] / ceiling["steps_per_s"])
    assert ceiling["info"]["processes"] >= 1
    check_png(tmp_path / "bench.png")


def test_bench_runner_failure_exits_1_after_writing_results(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import tests.cli_envs  # noqa: F401  (registers CrashAfter-v0 in this process)

    status, _, err = run_cli(
        capsys, "bench", "CrashAfter-v0", *TINY, "--num-envs", "2", "--runners", "loop,serial",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert status == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("envfleet: error: 2 runners failed: loop (2 envs); serial (2 envs)")
    assert any("loop failed with 2 envs: RuntimeError: boom at step 7" in line for line in lines)
    assert "Traceback" not in err
    document = json.loads((tmp_path / "bench.json").read_text())
    for name in ("loop", "serial"):
        assert document["runners"][name]["status"] == "failed"
        (point,) = document["runners"][name]["results"]
        assert "boom at step 7" in point["error"]
    check_png(tmp_path / "bench.png")


def test_a_peer_that_is_not_installed_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    missing = benchmark.RunnerKind(
        "missing", "", benchmark.open_loop, "envfleet_no_such_peer", extra="peers"
    )
    monkeypatch.setitem(benchmark.RUNNERS, "missing", missing)
    spec = EnvSpec.from_user(ENV)
    assert benchmark.availability("missing", spec).reason == (
        "envfleet_no_such_peer is not installed: pip install 'envfleet[peers]'"
    )
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for kind in benchmark.RUNNERS.values():  # every peer names the extra that installs it
        if kind.module is not None and kind.name != "missing":
            assert kind.extra in extras, kind.name
            root = kind.module.split(".")[0]
            assert any(d.replace("-", "_").startswith(root) for d in extras[kind.extra]), kind.name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--runners", "loop,nosuch"], "argument --runners: unknown runner 'nosuch': choose from"),
        (["--runners", ","], "argument --runners: no runner given"),
        (["--num-envs", "8,x"], "argument --num-envs: expected comma-separated positive integers"),
        (["--num-envs", "8,0"], "argument --num-envs: env counts must be at least 1, got 0"),
        (["--num-envs", ""], "argument --num-envs: expected comma-separated positive integers"),
        (["--seconds", "0"], "argument --seconds: must be a positive number"),
        (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ],
)
def test_bench_bad_arguments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    status, out, err = bench(capsys, tmp_path / "never", *argv)
    assert status == 2
    assert out == ""
    assert err.startswith("envfleet: error: ")
    assert err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "never").exists()


def test_bench_out_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    status, _, err = bench(capsys, file, "--runners", "loop")
    assert status == 2
    assert err == f"envfleet: error: --out {file} is a file, not a folder\n"


def test_bench_unknown_env_and_unknown_runner_subprocess(tmp_path: Path) -> None:
    result = run_subprocess("bench", "CartPol-v1", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("envfleet: error: unknown environment id 'CartPol-v1'")

    result = run_subprocess("bench", ENV, "--runners", "loop,gym-turbo", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown runner 'gym-turbo'" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_parse_runners() -> None:
    assert benchmark.parse_runners("loop, process,loop") == ["loop", "process"]
    assert benchmark.parse_runners("for-loop,envfleet-process") == ["loop", "process"]
    with pytest.raises(ValueError, match="unknown runner 'x'"):
        benchmark.parse_runners("loop,x")


# -- run --stats ---------------------------------------------------------------------------------


def run_stats(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = run_cli(capsys, "run", ENV, *argv, "--stats", "--json")
    assert status == 0, err
    summary: dict[str, Any] = json.loads(out)
    return summary


def check_stats(stats: dict[str, Any], num_envs: int, workers: int) -> None:
    assert len(stats["workers"]) == workers
    assert sum(w["steps"] for w in stats["workers"]) == stats["steps"]
    assert sum(w["episodes"] for w in stats["workers"]) == stats["episodes"]
    assert sorted(i for w in stats["workers"] for i in w["env_ids"]) == list(range(num_envs))
    assert stats["restarts"] == 0
    for index, worker in enumerate(stats["workers"]):
        assert worker["worker"] == index
        assert worker["steps"] > 0
        assert 0 <= worker["latency_p50_ms"] <= worker["latency_p99_ms"]
        assert 0.0 <= worker["idle_fraction"] <= 1.0
        assert worker["restarts"] == 0


def test_run_stats_json_sync(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--num-envs", "4", "--num-workers", "2", "--steps", "400")
    summary = run_stats(capsys, *argv)
    stats = summary["stats"]
    check_stats(stats, num_envs=4, workers=2)
    assert stats["steps"] == summary["steps"] == 400  # every step was a whole-batch step
    assert stats["episodes"] == summary["episodes"]
    assert [w["steps"] for w in stats["workers"]] == [200, 200]
    assert [w["env_ids"] for w in stats["workers"]] == [[0, 1], [2, 3]]


def test_run_stats_json_async(capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_stats(capsys, "--num-envs", "6", "--num-workers", "3", "--batch-size", "2",
                        "--steps", "300")  # fmt: skip
    stats = summary["stats"]
    check_stats(stats, num_envs=6, workers=3)
    # The pool also counts the steps still in flight when the run stopped.
    assert summary["steps"] <= stats["steps"] <= summary["steps"] + 6


def test_run_stats_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(
        capsys, "run", ENV, "--backend", "serial", "--num-envs", "3", "--steps", "300", "--stats"
    )
    assert status == 0, err
    assert "pool stats" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    worker = next(line for line in rows if line.split()[1] == "0")
    assert "0-2" in worker and "300" in worker
    assert any(line.split()[1] == "total" for line in rows)


def test_run_without_stats_has_none(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(
        capsys, "run", ENV, "--backend", "serial", "--num-envs", "2", "--steps", "10", "--json"
    )
    assert status == 0
    assert "stats" not in json.loads(out)


# -- start-up bound ------------------------------------------------------------------------------

STARTED: list[int] = []


def open_slowly(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
    """A contender whose start-up waits on a worker process that takes a minute to answer."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    STARTED.append(worker.pid)
    worker.wait()  # returns early only if the worker is killed
    raise RuntimeError("the worker died during start-up")


def test_bench_skips_a_contender_slow_to_start_and_reports_start_up_times(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = benchmark.RunnerKind("slow", "a contender slow to start", open_slowly)
    monkeypatch.setitem(benchmark.RUNNERS, "slow", slow)
    STARTED.clear()
    start = time.perf_counter()
    # The limit leaves the for-loop (2 CartPoles) time to start on a loaded machine.
    status, stdout, err = bench(
        capsys, tmp_path, "--num-envs", "2,4", "--runners", "loop,slow", "--startup-limit", "3"
    )
    elapsed = time.perf_counter() - start
    assert status == 0, err  # a skip is not a failure
    assert elapsed < 30  # not the minute the worker would take
    assert len(STARTED) == 1  # not tried again at 4 envs
    assert not psutil.pid_exists(STARTED[0]) or psutil.Process(STARTED[0]).status() == "zombie"
    main, startup = stdout.split("start-up, seconds to build and reset the envs (limit 3 s)")
    rows = {line.split()[1]: line for line in main.splitlines() if line.startswith("│")}
    cells = [cell.strip() for cell in rows["slow"].split("│")[1:-1]]
    assert cells == ["slow", "skipped", "skipped"]
    rows = {line.split()[1]: line for line in startup.splitlines() if line.startswith("│")}
    cells = [cell.strip() for cell in rows["slow"].split("│")[1:-1]]
    assert cells == ["slow", ">3", ">3"]
    loop = [cell.strip() for cell in rows["loop"].split("│")[2:-1]]
    assert len(loop) == 2 and all(float(s) >= 0 for s in loop)
    assert "slow: start-up over 3 s at 2 envs; skipped at 2, 4 envs" in stdout
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["runners"]["slow"]["status"] == "skipped"
    assert document["runners"]["loop"]["status"] == "ok"
    assert document["runners"]["slow"]["results"] == [
        {"num_envs": 2, "skipped": "start-up over 3 s, skipped"},
        {"num_envs": 4, "skipped": "start-up over 3 s at 2 envs, skipped"},
    ]
    assert document["timing"]["startup_limit"] == 3


OPENED: list[tuple[str, int]] = []


def start_up_of(seconds_per_env: float) -> Any:
    """A contender that reports a start-up of ``seconds_per_env`` per env (without taking it)."""

    def open_runner(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
        name = f"per-env-{seconds_per_env:g}"
        OPENED.append((name, workload.num_envs))
        setup_s = seconds_per_env * workload.num_envs
        return benchmark.CallRunner(name, lambda: 1, lambda: None, timing, setup_s=setup_s)

    return open_runner


def test_bench_does_not_start_a_contender_whose_start_up_would_be_far_over_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Start-up in proportion to the envs (SB3's one process per env): 4 s for 2 envs makes
    16 s for 8, far over the 5 s limit: not started at 8 (nor 16); 0.8 s for 2 envs makes 3.2 s
    for 8, under the limit, and 6.4 s for 16, near it: started at every count."""
    for per_env in (2.0, 0.4):
        kind = benchmark.RunnerKind(f"per-env-{per_env:g}", "", start_up_of(per_env))
        monkeypatch.setitem(benchmark.RUNNERS, kind.name, kind)
    OPENED.clear()
    timing = benchmark.Timing(seconds=0.01, warmup=0.0, rewarm=0.0, repeats=1, startup_limit=5)
    report = benchmark.sweep(ENV, [2, 8, 16], ["per-env-2", "per-env-0.4"], timing)
    assert OPENED == [("per-env-2", 2), ("per-env-0.4", 2), ("per-env-0.4", 8), ("per-env-0.4", 16)]
    slow = report.results["per-env-2"]
    assert isinstance(slow[2], benchmark.RunResult) and slow[2].setup_s == 4.0
    assert [str(slow[n]) for n in (8, 16)] == [
        "start-up over 5 s expected (4.0 s at 2 envs), skipped",
        "start-up over 5 s expected (4.0 s at 2 envs) at 8 envs, skipped",
    ]
    assert all(isinstance(r, benchmark.RunResult) for r in report.results["per-env-0.4"].values())
    assert (
        "per-env-2: start-up over 5 s expected (4.0 s at 2 envs) at 8 envs; skipped at 8, 16 envs"
        in (benchmark.report_notes(report))
    )


def test_bench_output_of_envs_goes_to_the_log_not_the_screen(tmp_path: Path) -> None:
    result = run_subprocess(
        "bench", "Noisy-v0", "--import", "tests.cli_envs", *TINY, "--num-envs", "2",
        "--runners", "loop,process,gym-async", "--out", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # nothing else on stdout
    assert result.stderr == ""
    log = (tmp_path / "bench.log").read_text()
    assert document["files"]["log"] == str(tmp_path / "bench.log")
    # This process, the process pool's workers and Gymnasium's subprocesses all printed.
    assert log.count("A.L.E: Arcade Learning Environment") >= 3
    assert log.count("NOISY: chatter on stdout") >= 3


def test_bench_piped_prints_a_line_per_stage_with_its_place(tmp_path: Path) -> None:
    result = run_subprocess(
        "bench", ENV, *TINY, "--num-envs", "2,3", "--runners", "loop,serial",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stages = [line.split("] ", 1) for line in result.stderr.splitlines() if line.startswith("[")]
    assert [what for _, what in stages] == [
        f"{ENV} x 2 (1 of 2): starting loop (1 of 2)",
        f"{ENV} x 2 (1 of 2): starting serial (2 of 2)",
        f"{ENV} x 3 (2 of 2): starting loop (1 of 2)",
        f"{ENV} x 3 (2 of 2): starting serial (2 of 2)",
    ]
    assert stages[0][0] == "[0%" and all(", ETA " in share for share, _ in stages[1:])
    assert "starting" not in result.stdout  # the table's stream has the results alone


def test_bench_vectorization_mode_measures_the_hosted_vector_env_beside_its_own(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--vectorization-mode vector_entry_point``: the id's VectorEnv alone, its ceiling,
    envfleet hosting it and envfleet's single envs, side by side; an id without a vector entry
    point is a usage error naming it, before anything runs."""
    status, _, err = bench(
        capsys, tmp_path / "h", "--num-envs", "16", "--vectorization-mode", "vector_entry_point"
    )
    assert status == 0, err
    document = json.loads((tmp_path / "h" / "bench.json").read_text())
    assert list(document["runners"]) == ["vector", "vector-ceiling", "hosted", "process"]
    for name, entry in document["runners"].items():
        assert entry["status"] == "ok", (name, entry)
    hosted = document["runners"]["hosted"]["results"][0]
    assert hosted["num_envs"] == 16 and hosted["steps_per_s"] > 0
    status, _, err = run_cli(
        capsys, "bench", "FrozenLake-v1", *TINY, "--out", str(tmp_path / "never"),
        "--vectorization-mode", "vector_entry_point",
    )  # fmt: skip
    assert status == 2 and "FrozenLake-v1 has no vector entry point" in err
    assert not (tmp_path / "never").exists()
