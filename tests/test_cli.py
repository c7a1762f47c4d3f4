"""The ``envfleet`` command line, run for real on CartPole-v1 (in-process and as a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

import envfleet
from envfleet.cli import EpisodeTracker, main

ENV = "CartPole-v1"
ROOT = Path(__file__).resolve().parent.parent
SERIAL = ["--backend", "serial"]


STAGES = (
    "envfleet: starting ",
    "envfleet: started ",
    "envfleet: done: ",
    "envfleet: interrupted: ",
)
"""How ``run``'s stage lines begin (on stderr, unless --quiet or --json)."""


def without_stages(err: str) -> str:
    """``err`` less ``run``'s stage lines: what the command said besides its progress."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith(STAGES))


def run_cli(
    capsys: pytest.CaptureFixture[str], *argv: str, stages: bool = False
) -> tuple[int, str, str]:
    """``envfleet ARGV`` in this process: (exit status, stdout, stderr), stderr less ``run``'s
    stage lines unless ``stages``."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err if stages else without_stages(captured.err)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = run_cli(capsys, "run", ENV, *argv, "--json")
    assert status == 0, err
    summary: dict[str, Any] = json.loads(out)  # stdout holds the JSON and nothing else
    return summary


def run_subprocess(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -m envfleet.cli ARGV`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "envfleet.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=False,
    )


def episodes_from_rollout(data: Any) -> tuple[list[float], list[int], np.ndarray]:
    """Episodic returns and lengths recomputed from a saved rollout, and its reset steps.

    Under NEXT_STEP autoreset, an env's row right after the end of an episode is its reset step
    and belongs to no episode; an episode still running at the end of the rollout is dropped.
    """
    returns: list[float] = []
    lengths: list[int] = []
    reset_steps = np.zeros(len(data["env_ids"]), dtype=bool)
    running: dict[int, float] = defaultdict(float)
    length: dict[int, int] = defaultdict(int)
    ended: dict[int, bool] = defaultdict(bool)
    for row, env in enumerate(data["env_ids"].tolist()):
        if ended[env]:
            reset_steps[row] = True
            ended[env] = False
            continue
        running[env] += float(data["rewards"][row])
        length[env] += 1
        if data["terminations"][row] or data["truncations"][row]:
            returns.append(running[env])
            lengths.append(length[env])
            running[env], length[env], ended[env] = 0.0, 0, True
    return returns, lengths, reset_steps


def check_summary(summary: dict[str, Any], num_envs: int, steps: int, batch: int) -> None:
    assert summary["env"] == ENV
    assert summary["num_envs"] == num_envs
    assert summary["batch_size"] == batch
    assert steps <= summary["steps"] < steps + batch
    assert summary["steps"] % batch == 0
    assert summary["seconds"] > 0
    assert summary["steps_per_second"] == pytest.approx(summary["steps"] / summary["seconds"])
    assert summary["episodes"] > 0
    assert summary["return_min"] <= summary["return_mean"] <= summary["return_max"]
    # CartPole pays 1 per step: a return is the episode's length.
    assert summary["length_mean"] == pytest.approx(summary["return_mean"])
    assert summary["interrupted"] is False


# -- summaries -----------------------------------------------------------------------------------


def test_run_sync_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_json(capsys, *SERIAL, "--num-envs", "4", "--steps", "1001", "--seed", "3")
    check_summary(summary, num_envs=4, steps=1001, batch=4)
    assert summary["steps"] == 1004
    assert summary["backend"] == "serial"
    assert summary["num_workers"] == 1
    assert summary["seed"] == 3
    assert summary["policy"] == "random"
    assert summary["out"] is None


def test_run_async_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_json(capsys, *SERIAL, "--num-envs", "8", "--batch-size", "4", "--steps", "1000")
    check_summary(summary, num_envs=8, steps=1000, batch=4)


def test_same_seed_same_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (*SERIAL, "--num-envs", "4", "--steps", "400", "--seed", "7")
    first, second = run_json(capsys, *argv), run_json(capsys, *argv)
    keys = ("steps", "episodes", "return_mean", "return_min", "return_max")
    assert [first[k] for k in keys] == [second[k] for k in keys]


def test_seconds_limit(capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_json(capsys, *SERIAL, "--num-envs", "2", "--seconds", "0.3")
    assert 0.3 <= summary["seconds"] < 10
    assert summary["steps"] > 0


def test_table_summary_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(
        capsys, "run", ENV, *SERIAL, "--num-envs", "2", "--steps", "300", stages=True
    )
    assert status == 0, err
    for text in (ENV, "serial", "steps/s", "episodes", "mean return", "300"):
        assert text in out
    # stderr is not a terminal: no live display, a plain line per stage instead
    lines = err.splitlines()
    assert [line.split(":")[1].split()[0] for line in lines] == ["starting", "started", "done"]
    assert lines[0] == (
        f"envfleet: starting {ENV}: 2 envs in this process (serial backend); then 300 steps"
    )
    assert lines[2].startswith("envfleet: done: 300 steps in 0:0")


# -- saved rollouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [None, 4], ids=["sync", "async"])
def test_out_npz_matches_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, batch_size: int | None
) -> None:
    out = tmp_path / "rollout.npz"
    batch = ["--batch-size", str(batch_size)] if batch_size else []
    summary = run_json(
        capsys, *SERIAL, "--num-envs", "8", *batch, "--steps", "2000", "--out", str(out)
    )
    assert summary["out"] == str(out)
    data = np.load(out)
    steps = summary["steps"]
    assert set(data.files) == {
        "env_ids",
        "actions",
        "rewards",
        "terminations",
        "truncations",
        "autoreset",
    }
    for name in data.files:
        assert data[name].shape == (steps,), name
    assert data["terminations"].dtype == np.bool_
    assert set(np.unique(data["env_ids"]).tolist()) == set(range(8))
    assert np.bincount(data["env_ids"]).max() - np.bincount(data["env_ids"]).min() <= 1
    assert set(np.unique(data["actions"]).tolist()) <= {0, 1}

    returns, lengths, reset_steps = episodes_from_rollout(data)
    np.testing.assert_array_equal(data["autoreset"], reset_steps)
    assert (data["rewards"][reset_steps] == 0).all()
    assert not (data["terminations"] | data["truncations"])[reset_steps].any()
    assert len(returns) == summary["episodes"] > 0
    assert np.mean(returns) == pytest.approx(summary["return_mean"])
    assert min(returns) == summary["return_min"]
    assert max(returns) == summary["return_max"]
    assert np.mean(lengths) == pytest.approx(summary["length_mean"])
    # Every step is in an episode, a reset step, or the unfinished episode of its env.
    assert sum(lengths) + reset_steps.sum() <= steps


@pytest.mark.parametrize("batch_size", [None, 3], ids=["sync", "async"])
def test_saved_rollout_replays_exactly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, batch_size: int | None
) -> None:
    """Replaying each env's saved actions from its seed gives the saved obs, rewards and flags."""
    out = tmp_path / "rollout"  # ".npz" is added
    batch = ["--batch-size", str(batch_size)] if batch_size else []
    summary = run_json(
        capsys,
        *SERIAL,
        "--num-envs",
        "4",
        *batch,
        "--steps",
        "600",
        "--seed",
        "11",
        "--out",
        str(out),
        "--save-obs",
    )
    assert summary["out"] == str(tmp_path / "rollout.npz")
    data = np.load(tmp_path / "rollout.npz")
    assert data["observations"].shape == (summary["steps"], 4)
    assert data["observations"].dtype == np.float32
    for env_index in range(4):
        rows = np.flatnonzero(data["env_ids"] == env_index)
        env = gymnasium.make(ENV)
        obs, _ = env.reset(seed=11 + env_index)
        done = False
        for row in rows:
            np.testing.assert_array_equal(data["observations"][row], obs)
            if done:  # NEXT_STEP: this row is the reset step; its action is ignored
                assert data["autoreset"][row]
                obs, _ = env.reset()
                reward, terminated, truncated = 0.0, False, False
            else:
                assert not data["autoreset"][row]
                obs, reward, terminated, truncated, _ = env.step(int(data["actions"][row]))
            assert data["rewards"][row] == reward
            assert data["terminations"][row] == terminated
            assert data["truncations"][row] == truncated
            done = terminated or truncated
        env.close()


# -- policies ------------------------------------------------------------------------------------


def test_policy_from_module(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "zero.npz"
    summary = run_json(
        capsys,
        *SERIAL,
        "--num-envs",
        "4",
        "--steps",
        "400",
        "--policy",
        "tests.cli_policies:always_zero",
        "--out",
        str(out),
    )
    assert summary["policy"] == "tests.cli_policies:always_zero"
    assert summary["episodes"] > 0
    # Always pushing left topples the pole within a few steps.
    assert summary["return_max"] < 20
    data = np.load(out)
    assert (data["actions"] == 0).all()


@pytest.mark.parametrize("batch_size", [None, 3], ids=["sync", "async"])
def test_policy_wrong_shape(capsys: pytest.CaptureFixture[str], batch_size: int | None) -> None:
    batch = ["--batch-size", str(batch_size)] if batch_size else []
    policy = "tests.cli_policies:wrong_shape"
    status, out, err = run_cli(capsys, "run", ENV, *SERIAL, *batch, "--policy", policy)
    assert status == 1
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"envfleet: error: policy {policy} returned invalid actions")
    expected = batch_size or 8
    assert f"expected actions of shape ({expected},)" in err
    assert f"got shape ({expected + 1},)" in err
    assert "Traceback" not in err


def test_policy_that_raises(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(
        capsys, "run", ENV, *SERIAL, "--policy", "tests.cli_policies:raises", "--steps", "10"
    )
    assert status == 1
    assert err == (
        "envfleet: error: policy tests.cli_policies:raises raised ZeroDivisionError: "
        "the policy divided by zero\n"
    )


def test_debug_shows_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(
        capsys, "run", ENV, *SERIAL, "--policy", "tests.cli_policies:raises", "--debug"
    )
    assert status == 1
    assert "Traceback" in err
    assert "ZeroDivisionError" in err
    assert err.splitlines()[-1].startswith("envfleet: error: policy")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("no_such_module_xyz:act", "no module named 'no_such_module_xyz'"),
        ("tests.cli_policies:missing", "has no attribute 'missing'"),
        ("tests.cli_policies:not_callable", "is not callable"),
        ("tests.cli_policies", "must look like 'module:function'"),
    ],
)
def test_policy_that_cannot_be_loaded(
    capsys: pytest.CaptureFixture[str], policy: str, message: str
) -> None:
    status, out, err = run_cli(capsys, "run", ENV, *SERIAL, "--policy", policy)
    assert status == 2
    assert out == ""
    assert err.startswith("envfleet: error: ")
    assert err.count("\n") == 1
    assert message in err


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-envs", "0"], "argument --num-envs: must be at least 1, got 0"),
        (["--num-envs", "two"], "argument --num-envs: expected a positive integer, got 'two'"),
        (["--steps", "-5"], "argument --steps: must be at least 1, got -5"),
        (["--seconds", "0"], "argument --seconds: must be a positive number"),
        (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["--backend", "nosuch"], "argument --backend: invalid choice: 'nosuch'"),
        (["--batch-size", "9"], "--batch-size 9 exceeds --num-envs 8"),
        (["--num-workers", "9"], "--num-workers 9 exceeds --num-envs 8"),
        (["--steps", "10", "--seconds", "1"], "not allowed with argument"),
        (["--save-obs"], "--save-obs needs --out"),
        (["--out", "/no/such/folder/x.npz"], "folder /no/such/folder does not exist"),
        (["--cpu-affinity", "0,x"], "argument --cpu-affinity: expected 'spread', CPU ids"),
        (["--cpu-affinity", "0"], "cpu_affinity needs a backend with workers to pin: thread,"),
        (["--threads-per-worker", "2"], "threads_per_worker needs a backend that can step a"),
        (["--address", "auto"], "address is an option of backend='ray'; got backend='serial'"),
        (["--on-error", "ignore"], "argument --on-error: invalid choice: 'ignore'"),
        (["--step-timeout", "0"], "argument --step-timeout: must be a positive number"),
    ],
)
def test_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    status, out, err = run_cli(capsys, "run", ENV, *SERIAL, *argv)
    assert status == 2
    assert out == ""
    assert err.startswith("envfleet: error: ")
    assert err.count("\n") == 1
    assert message in err


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys)
    assert status == 2
    assert err.startswith("envfleet: error: the following arguments are required: COMMAND")


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "run", "--help")
    assert status == 0
    for option in ("--num-envs", "--batch-size", "--policy", "--out", "--save-obs", "--json"):
        assert option in out


# -- subprocesses: the real command --------------------------------------------------------------


def test_unknown_env_id_subprocess() -> None:
    result = run_subprocess("run", "CartPol-v1", "--steps", "10")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        "envfleet: error: unknown environment id 'CartPol-v1'; did you mean 'CartPole-v1'?"
    )


def test_process_backend_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "process.npz"
    result = run_subprocess(
        "run",
        ENV,
        "--backend",
        "process",
        "--num-envs",
        "4",
        "--num-workers",
        "2",
        "--steps",
        "2000",
        "--out",
        str(out),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    check_summary(summary, num_envs=4, steps=2000, batch=4)
    assert summary["backend"] == "process"
    assert summary["num_workers"] == 2
    returns, _, _ = episodes_from_rollout(np.load(out))
    assert len(returns) == summary["episodes"]
    assert np.mean(returns) == pytest.approx(summary["return_mean"])


def test_process_backend_async_subprocess() -> None:
    result = run_subprocess(
        "run", ENV, "--num-envs", "8", "--batch-size", "4", "--num-workers", "2", "--steps", "2000"
    )
    assert result.returncode == 0, result.stderr
    assert "steps/s" in result.stdout
    assert "Traceback" not in result.stderr


def test_console_script() -> None:
    script = Path(sys.executable).parent / "envfleet"
    if not script.exists():
        pytest.skip("the envfleet console script is not installed (pip install -e .)")
    result = subprocess.run(
        [str(script), "run", ENV, "--backend", "serial", "--steps", "100", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 104


# -- episode bookkeeping -------------------------------------------------------------------------


def test_episode_tracker_next_step_semantics() -> None:
    tracker = EpisodeTracker(num_envs=2, recent=2)
    ids = np.array([0, 1])

    def update(rewards: list[float], terminated: list[bool], truncated: list[bool]) -> list[bool]:
        flags = tracker.update(
            ids, np.array(rewards), np.array(terminated), np.array(truncated)
        ).tolist()
        return [bool(flag) for flag in flags]

    assert update([1, 2], [False, False], [False, False]) == [False, False]
    assert update([1, 2], [True, False], [False, False]) == [False, False]  # env 0 ends: 2
    assert update([0, 2], [False, False], [False, True]) == [True, False]  # env 0 resets; 1 ends
    assert update([5, 0], [False, False], [False, False]) == [False, True]
    assert update([5, 1], [True, True], [False, False]) == [False, False]  # 0 ends: 10; 1: 1
    assert tracker.returns == [2.0, 6.0, 10.0, 1.0]
    assert tracker.lengths == [2, 3, 2, 1]
    assert list(tracker.recent) == [10.0, 1.0]
    # Out-of-order subsets of envs (async batches).
    tracker.update(np.array([1]), np.array([0.0]), np.array([False]), np.array([False]))
    tracker.update(
        np.array([1, 0]), np.array([3.0, 0.0]), np.array([True, False]), np.zeros(2, bool)
    )
    assert tracker.returns[-1] == 3.0
    assert tracker.episodes == 5


# -- failures while running ----------------------------------------------------------------------


def test_on_error_restart_keeps_the_run_going_and_counts_restarts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import tests.cli_envs  # noqa: F401  (registers CrashAfter-v0 in this process)

    argv = ["run", "CrashAfter-v0", *SERIAL, "--num-envs", "2", "--steps", "100", "--json"]
    status, out, err = run_cli(capsys, *argv, "--on-error", "restart")
    assert status == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 100 and summary["on_error"] == "restart"
    # Each env raises on the 7th step of its life: about once per 7 of its 50 steps.
    assert 10 <= summary["restarts"] <= 16


def test_pool_options_reach_the_pool(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []
    real_make = envfleet.make

    def make(*args: Any, **kwargs: Any) -> envfleet.Pool:
        made.append(kwargs)
        return real_make(*args, **kwargs)

    monkeypatch.setattr(envfleet, "make", make)
    cpu = max(os.sched_getaffinity(0))
    argv = ["--backend", "process", "--num-envs", "4", "--num-workers", "2", "--steps", "400"]
    options = ["--threads-per-worker", "2", "--cpu-affinity", str(cpu), "--step-timeout", "30"]
    summary = run_json(capsys, *argv, *options, "--max-restarts", "5", "--on-error", "restart")
    (kwargs,) = made
    assert kwargs["threads_per_worker"] == 2 and kwargs["cpu_affinity"] == [cpu]
    assert (kwargs["step_timeout"], kwargs["max_restarts"]) == (30.0, 5)
    assert kwargs["on_error"] == "restart" and kwargs["address"] is None
    assert (summary["threads_per_worker"], summary["cpu_affinity"]) == (2, [cpu])
    assert summary["steps"] == 400 and summary["restarts"] == 0


def test_env_failure_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import tests.cli_envs  # noqa: F401  (registers CrashAfter-v0 in this process)

    argv = ["run", "CrashAfter-v0", *SERIAL, "--num-envs", "2", "--steps", "100"]
    status, out, err = run_cli(capsys, *argv)
    assert status == 1
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("envfleet: error: ")
    assert "RuntimeError" in err
    assert "boom at step 7" in err
    assert "Traceback" not in err

    status, _, err = run_cli(capsys, *argv, "--debug")
    assert status == 1
    assert "Traceback" in err
    assert err.splitlines()[-1].startswith("envfleet: error: ")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("CrashValueError-v0", "env value error at step 7"),
        ("BrokenConstructor-v0", "env type error in __init__"),
    ],
)
def test_an_env_raising_value_or_type_error_is_an_env_failure_not_usage(
    capsys: pytest.CaptureFixture[str], env: str, message: str
) -> None:
    """The pool's errors are also of the env's own type (a ValueError here): still reported as
    the env's failure (status 1), not as bad actions from the policy or a usage error."""
    import tests.cli_envs  # noqa: F401  (registers the ids in this process)

    argv = ["run", env, *SERIAL, "--num-envs", "2", "--steps", "100"]
    status, out, err = run_cli(capsys, *argv)
    assert (status, out) == (1, ""), err
    assert err.startswith("envfleet: error: ")
    assert message in err
    assert "policy" not in err and "usage" not in err


# -- the first hour: python -m envfleet, --import, mistyped options, the cli extra -------------


def test_mistyped_option_points_to_the_subcommand_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "run", ENV, "--num-env", "4")
    assert status == 2 and out == ""
    assert err == (
        "envfleet: error: unrecognized arguments: --num-env 4 (see 'envfleet run --help')\n"
    )


def test_python_m_envfleet_imports_the_users_module_from_the_current_directory(
    tmp_path: Path,
) -> None:
    """``python -m envfleet`` works; ``--import mysim`` registers MySim-v0 from the current
    directory even where Python itself does not put it on the path (``-P``, as for the console
    script), and the process backend's workers find it too."""
    (tmp_path / "mysim.py").write_text(
        "import gymnasium\n"
        "gymnasium.register('MySim-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv',"
        " max_episode_steps=5)\n"
    )
    argv = ["run", "MySim-v0", "--num-envs", "2", "--steps", "200", "--json"]
    result = subprocess.run(
        [sys.executable, "-P", "-m", "envfleet", *argv, "--import", "mysim"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["env"] == "MySim-v0" and summary["steps"] >= 200
    assert summary["backend"] == "process"
    assert summary["episodes"] > 0
    assert summary["length_mean"] <= 5  # the user's registration, not CartPole-v1's


def test_an_unknown_id_points_to_import(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "run", "MySim-v0")
    assert status == 2
    assert err.startswith("envfleet: error: unknown environment id 'MySim-v0'")
    assert err.endswith(" (registered by a module of yours? --import MODULE, or MODULE:MySim-v0)\n")


def test_an_id_whose_module_is_missing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "run", "no_such_sim_module:MySim-v0")
    assert status == 2
    assert err.startswith("envfleet: error: unknown environment id 'no_such_sim_module:MySim-v0'")
    assert err.endswith(
        "; importing 'no_such_sim_module' failed: No module named 'no_such_sim_module'\n"
    )


def test_import_of_a_missing_module_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "run", ENV, "--import", "no_such_sim_module")
    assert status == 2
    assert err.startswith("envfleet: error: --import no_such_sim_module: no module named")


def test_without_the_cli_extra_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from envfleet.__main__ import main as entry

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "rich" else find_spec(name)
    )
    assert entry(["run", ENV]) == 2
    err = capsys.readouterr().err
    assert err == "envfleet: error: the command line needs rich: pip install 'envfleet[cli]'\n"


def test_the_library_needs_none_of_the_cli_extra() -> None:
    """``import envfleet; envfleet.make(...)`` imports neither rich nor matplotlib (the ``cli``
    extra), nor psutil (imported only by ``worker_memory_limit`` and the private Ray's reaper)."""
    code = (
        "import sys, envfleet\n"
        "with envfleet.make('CartPole-v1', 2, num_workers=2, seed=0) as pool:\n"
        "    pool.reset(); pool.step([0, 1])\n"
        "print(sorted(m.split('.')[0] for m in sys.modules "
        "if m.split('.')[0] in ('rich', 'psutil', 'matplotlib')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("env_id", ["ALE/NoSuchGame-v5", "NoSuchGame-v0", "CartPol-v1"])
def test_an_atari_id_without_ale_py_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, env_id: str
) -> None:
    """``ALE/...`` ids need ale-py, as the extras table says; an id that is not an Atari game's
    gets no install line (the old Atari ids, which ale-py registers too: tests/test_id_hints.py).
    """
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "ale_py" else find_spec(name)
    )
    with pytest.raises(ValueError) as error:
        envfleet.EnvSpec.from_user(env_id)
    if env_id.startswith("ALE/"):
        assert str(error.value) == (
            f"unknown environment id {env_id!r}: Atari ids need ale-py: "
            "pip install 'envfleet[atari]'"
        )
    else:
        assert "pip install" not in str(error.value)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError) as error:  # with ale-py: a plain unknown id
        envfleet.EnvSpec.from_user(env_id)
    assert "ale-py" not in str(error.value)


def test_run_keeps_banners_off_the_screen_and_shows_other_output_after() -> None:
    """Noisy-v0 prints an ale-py-like banner (fd 2, from C in real life), a warning and a
    line on stdout, in every process that builds it: the banner is dropped, the rest is shown
    on stderr after the run, and stdout holds the JSON alone."""
    result = run_subprocess(
        "run", "Noisy-v0", "--import", "tests.cli_envs", "--num-envs", "2", "--steps", "50",
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["env"] == "Noisy-v0"
    assert "A.L.E" not in result.stderr
    lines = result.stderr.splitlines()
    assert "NOISY: a warning from the env" in lines and "NOISY: chatter on stdout" in lines


def test_known_banners_are_dropped_and_the_rest_kept() -> None:
    from envfleet.cli.common import OutputCapture

    captured = OutputCapture()
    captured.text = (
        "A.L.E: Arcade Learning Environment (version 0.11.2+ecc1138)\n"
        "[Powered by Stella]\n"
        "Gym has been unmaintained since 2022 and does not support NumPy 2.0 amongst other\n"
        "2026-12-01 03:09:20,864\tINFO worker.py:2038 -- Started a local Ray instance.\n"
        "2026-12-01 03:09:19,147\tWARNING authentication_token_setup.py:85 -- Token auth\n"
        "2026-12-01 03:09:21,000\tERROR worker.py:1 -- a real Ray error\n"
        "UserWarning: my env's own warning\n"
    )
    assert captured.unexpected() == (
        "2026-12-01 03:09:21,000\tERROR worker.py:1 -- a real Ray error\n"
        "UserWarning: my env's own warning\n"
    )


def test_the_ray_backend_without_ray_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import envfleet\n"
        "envfleet.make('CartPole-v1', 2, backend='ray')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == "ImportError: backend='ray' needs Ray: pip install 'envfleet[ray]'"


def test_the_benchmark_engine_without_rich_says_what_to_install() -> None:
    code = (
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'rich' else find(name, *a)\n"
        "import envfleet.benchmark"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == "ImportError: envfleet.benchmark needs rich: pip install 'envfleet[cli]'"
