"""``envfleet tune``, run for real on CartPole-v1 with a small budget."""

from __future__ import annotations

import ast
import functools
import json
import time
from typing import Any

import pytest

import envfleet
from envfleet.cli import TUNE_MIN_WINDOW, tune_layouts
from envfleet.cli.layout_timing import MIN_STEPS_PER_ENV
from envfleet.spec import EnvSpec
from tests import timing
from tests.envs import FaultyEnv
from tests.test_cli import ENV, run_cli

BACKENDS = {backend.value for backend in envfleet.Backend}


def parse_make_line(line: str, num_envs: int) -> tuple[ast.Expression, dict[str, Any]]:
    """Check ``line`` is ``envfleet.make(ENV, num_envs, **literals)``; return it and the kwargs."""
    tree = ast.parse(line, mode="eval")
    call = tree.body
    assert isinstance(call, ast.Call)
    assert ast.unparse(call.func) == "envfleet.make"
    assert [ast.literal_eval(arg) for arg in call.args] == [ENV, num_envs]
    kwargs: dict[str, Any] = {}
    for keyword in call.keywords:
        assert keyword.arg is not None  # no **spread
        kwargs[keyword.arg] = ast.literal_eval(keyword.value)
    assert kwargs["backend"] in BACKENDS
    return tree, kwargs


def test_tune_json_names_a_valid_layout_that_works(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    status, out, err = run_cli(capsys, "tune", ENV, "--num-envs", "4", "--budget", "2", "--json")
    elapsed = time.perf_counter() - start
    assert status == 0, err
    document: dict[str, Any] = json.loads(out)  # stdout holds the JSON and nothing else
    assert document["env"] == ENV
    assert document["num_envs"] == 4
    assert document["budget_s"] == 2
    # The budget, plus pools starting and closing: 8 s, or more on a machine busy enough that
    # a pool's life costs more than a second (measured now).
    assert elapsed < 2 + timing.bound(8.0, pools=8)

    profile = document["profile"]
    assert profile["step_seconds"] > 0
    assert profile["reset_seconds"] > 0
    assert profile["step_cv"] >= 0
    assert 0 < profile["cpu_share"] <= 1
    assert profile["observation_bytes"] == 4 * 4  # four float32
    assert profile["waits"] is False

    layouts = [layout for layout in document["layouts"] if layout["skipped"] is None]
    assert len(layouts) >= 2
    assert all(
        layout["skipped"] == "budget spent" for layout in document["layouts"][len(layouts) :]
    )
    for layout in layouts:
        assert layout["error"] is None, layout
        assert layout["steps_per_second"] > 0
        assert layout["window_s"] >= TUNE_MIN_WINDOW
        assert layout["backend"] in BACKENDS
        assert layout["untrusted"] is None and layout["steps_per_env"] >= MIN_STEPS_PER_ENV
    best = document["best"]
    assert best["steps_per_second"] == max(layout["steps_per_second"] for layout in layouts)

    tree, kwargs = parse_make_line(document["make"], num_envs=4)
    assert kwargs == best["make_kwargs"]
    pool = eval(compile(tree, "<make line>", "eval"), {"envfleet": envfleet})
    with pool:
        assert isinstance(pool, envfleet.Pool)
        pool.reset(seed=0)
        observations = pool.step(pool.action_space.sample())[0]
        assert observations.shape == (4, 4)


def test_tune_prints_profile_layouts_best_and_make_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run_cli(capsys, "tune", ENV, "--num-envs", "2", "--budget", "1")
    assert status == 0, err
    for text in ("step time", "reset time", "CPU share", "observation", "16 bytes", "steps/s"):
        assert text in out, text
    lines = out.strip().splitlines()
    assert lines[-2].startswith("best: ")
    assert "steps/s" in lines[-2]
    _, kwargs = parse_make_line(lines[-1], num_envs=2)
    assert lines[-2].startswith(f"best: {kwargs['backend']}, ")


def test_tune_layouts_hold_the_budget() -> None:
    spec = EnvSpec.from_user(ENV)
    start = time.perf_counter()
    _, timings = tune_layouts(spec, 2, budget=2.0, cores=2)
    elapsed = time.perf_counter() - start
    timed = [t for t in timings if t.skipped is None]
    assert len(timed) >= 2
    assert all(t.ranked and t.steps_per_env >= MIN_STEPS_PER_ENV for t in timed)
    assert all(t.window_s >= TUNE_MIN_WINDOW for t in timed)
    # The issue asks for +-10%; the slack is for a pool started or closed late on a loaded
    # machine (2 s, or two pools' lives as measured now).
    assert 2.0 * 0.7 <= elapsed <= 2.0 * 1.1 + timing.bound(2.0, pools=2)


def test_tune_uses_the_budget_when_a_start_up_took_longer_than_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pools that take 0.2 s to start and close, then 0.6 s: after two layouts about 0.64 s of a
    3 s budget is left, less than the slowest start-up (0.6 s) plus a window. Stopping there
    would leave a fifth of the budget unused, and a typical start-up (0.4 s) leaves room for a
    window: a third layout is timed, and the budget holds."""
    from envfleet.cli import layout_timing

    overheads = [0.2, 0.6]
    windows: list[float] = []

    def time_layout(
        spec: EnvSpec, num_envs: int, layout: Any, seconds: float, *, deadline: float, **_: Any
    ) -> Any:
        overhead = overheads[min(len(windows), len(overheads) - 1)]
        time.sleep(overhead / 2)  # start
        began = time.perf_counter()
        time.sleep(max(0.0, min(began + seconds, deadline) - began))
        stepped = time.perf_counter() - began
        time.sleep(overhead / 2)  # close
        windows.append(seconds)
        return layout_timing.Measurement(1000.0, 10.0, stepped)

    monkeypatch.setattr(layout_timing, "time_layout", time_layout)
    start = time.perf_counter()
    _, timings = tune_layouts(EnvSpec.from_user(ENV), 8, budget=3.0, cores=2)
    elapsed = time.perf_counter() - start
    assert len(windows) == 3 and windows[2] >= TUNE_MIN_WINDOW
    assert [t.skipped for t in timings[:3]] == [None, None, None]
    assert 3.0 * 0.9 <= elapsed <= 3.0 * 1.1 + 0.5  # the slack is for a loaded machine


def test_tune_does_not_rank_a_window_too_short_for_the_env() -> None:
    """An env stepping in 100 ms cannot be stepped 5 times per env in a 0.5 s budget: the one
    timing is reported untrusted, not ranked, and the budget holds anyway."""
    spec = EnvSpec.from_user(functools.partial(FaultyEnv, sleep=0.1))
    start = time.perf_counter()
    _, timings = tune_layouts(spec, 4, budget=0.5, cores=2)
    assert time.perf_counter() - start < 0.5 + timing.bound(4.0, pools=4)
    first = timings[0]
    assert first.untrusted is not None and "steps per env" in first.untrusted
    assert first.steps_per_env < MIN_STEPS_PER_ENV and not first.ranked
    assert all(t.skipped == "budget spent" for t in timings[1:])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "0"], "argument --budget: must be a positive number"),
        (["--budget", "soon"], "argument --budget: expected a positive number, got 'soon'"),
        (["--num-envs", "0"], "argument --num-envs: must be at least 1, got 0"),
    ],
)
def test_tune_bad_arguments(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run_cli(capsys, "tune", ENV, *argv)
    assert status == 2
    assert out == ""
    assert err.startswith("envfleet: error: ")
    assert err.count("\n") == 1
    assert message in err


def test_tune_unknown_env(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "tune", "CartPol-v1", "--budget", "1")
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("envfleet: error: unknown environment id 'CartPol-v1'")


def test_tune_env_that_crashes(capsys: pytest.CaptureFixture[str]) -> None:
    import tests.cli_envs  # noqa: F401  (registers CrashAfter-v0 in this process)

    status, out, err = run_cli(capsys, "tune", "CrashAfter-v0", "--budget", "1")
    assert status == 1
    assert out == ""
    assert err == "envfleet: error: probing CrashAfter-v0 failed: RuntimeError: boom at step 7\n"


def test_tune_times_the_layouts_with_the_policy_in_the_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--policy``: every layout is timed with the policy choosing each batch's actions, and
    the double-buffered async layouts (half the envs per batch, one leaving a core to the
    policy) are among the candidates."""
    from tests import cli_policies

    cli_policies.SEEN_BATCHES.clear()
    policy = "tests.cli_policies:counting"
    status, out, err = run_cli(
        capsys, "tune", ENV, "--num-envs", "4", "--budget", "3", "--policy", policy, "--json"
    )
    assert status == 0, err
    document: dict[str, Any] = json.loads(out)
    assert document["policy"] == policy
    candidates = [(t["backend"], t["num_workers"], t["batch_size"]) for t in document["layouts"]]
    cores = document["usable_cores"]
    assert ("process", min(cores, 4), 2) in candidates
    if cores > 1:
        assert ("process", min(cores - 1, 4), 2) in candidates
    timed = [t for t in document["layouts"] if t["skipped"] is None]
    assert all(t["error"] is None for t in timed), timed
    # The policy chose the actions of every timed batch: whole-pool batches for sync layouts,
    # half-pool ones for the double-buffered layouts that were timed.
    sizes = {t["batch_size"] or 4 for t in timed}
    assert set(cli_policies.SEEN_BATCHES) == sizes
    steps = sum(t["steps_per_env"] * 4 for t in timed)
    assert sum(cli_policies.SEEN_BATCHES) >= steps


def test_tune_refuses_a_policy_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(capsys, "tune", ENV, "--policy", "tests.cli_policies:nope")
    assert status != 0
    assert "has no attribute 'nope'" in err
