"""The benchmark engine's own runners (the bare pools against SyncVectorEnv, the ceiling,
ale-py's vector env, envfleet's variants), CPU by role, a script's cases, the sweep's progress
and the plot's notes."""

from __future__ import annotations

import os
from pathlib import Path

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium.vector import SyncVectorEnv

import envfleet
from bench.common import paired_args, script_parser, timing_from
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import runners
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
    workload = benchmark.Workload.of(_builds_here_only, 2)
    with pytest.raises(RuntimeError, match="a bare worker died"):
        benchmark.open_bare_pool(workload, TIMING, num_workers=2)
    with pytest.raises(RuntimeError, match="a bare-nodes worker or agent died"):
        benchmark.BarePool(benchmark.Workload.of(_builds_here_only, 4), TIMING, 2, nodes=2)
    with pytest.raises(ValueError, match="1 workers cannot serve 2 nodes"):
        benchmark.BarePool(benchmark.Workload.of(FaultyEnv, 4), TIMING, 1, nodes=2)


HERE = os.getpid()


def _builds_here_only() -> FaultyEnv:
    """An env that builds in this process (the bare pool's probe) and in no other."""
    if os.getpid() != HERE:
        raise OSError("no simulator here")
    return FaultyEnv()


@pytest.mark.parametrize(("workers", "nodes"), [(2, 0), (3, 0), (4, 2)])
def test_bare_pool_rows_are_those_of_sync_vector_env_for_the_same_actions(
    workers: int, nodes: int
) -> None:
    # CartPole's rows depend on every action, and its episodes end (and autoreset) within the
    # 60 steps; every field of every row is compared with SyncVectorEnv's (NEXT_STEP autoreset).
    workload = benchmark.Workload.of("CartPole-v1", 7)
    nice = 7 if nodes else None  # the agents' and their workers', as Ray's actors have one
    pool = benchmark.BarePool(workload, benchmark.Timing(seed=5), workers, nodes, nice)
    processes = [psutil.Process(pid) for pids in pool.pids.values() for pid in pids]
    assert all(p.nice() == (nice or psutil.Process().nice()) for p in processes)
    reference = SyncVectorEnv([workload.factory()] * 7)
    reference.reset(seed=5)
    rng = np.random.default_rng(0)
    try:
        assert pool.layout == ([2, 2] if nodes else [workers])
        assert (len(pool.pids["agents"]), len(pool.pids["workers"])) == (nodes, workers)
        ended = 0
        for _ in range(60):
            actions = rng.integers(0, 2, size=7)
            got, want = pool.step(actions), reference.step(actions)[:4]
            for field, a, b in zip(benchmark.FIELDS, got, want, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=field)
            ended += int(np.sum(want[2] | want[3]))
        assert ended > 0
    finally:
        pool.close()
        reference.close()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


def test_bare_pool_runner_steps_with_sampled_actions() -> None:
    workload = benchmark.Workload.of(FaultyEnv, 3)
    runner = benchmark.open_bare_pool(workload, TIMING, 2)
    try:
        assert runner.info == {"workers": 2}
        assert runner.advance() == 3  # type: ignore[attr-defined]
    finally:
        runner.close()


def _windows(*figures: tuple[float, float]) -> list[benchmark.CpuWindow]:
    return [benchmark.CpuWindow(wall, {"driver": cpu}, cpu, 2 * wall) for wall, cpu in figures]


def test_a_cpu_ratio_pairs_the_rounds_and_compare_names_every_role() -> None:
    mine = _windows((10.0, 4.0), (30.0, 9.0), (20.0, 6.0))
    bare = _windows((5.0, 2.0), (10.0, 3.0), (40.0, 2.0))
    # per round 2, 3, 0.5: the median of those, not 20 / 10
    assert benchmark.paired_ratio(mine, bare, lambda w: w.wall_us) == 2.0
    zero = _windows((1.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    assert benchmark.paired_ratio(mine, zero, lambda w: w.cpu_us) is None
    compared = benchmark.compare(mine, bare)
    assert list(compared) == ["driver", "all processes", "thread", "wall", "machine"]
    assert compared["driver"] == {"envfleet_us": 6.0, "bare_us": 2.0, "ratio": 3.0}
    assert "alone_us" in benchmark.compare(mine, bare, "alone")["wall"]


def test_roles_name_the_driver_each_worker_and_the_rest() -> None:
    with envfleet.make(FaultyEnv, 4, backend="process", num_workers=2) as pool:
        roles = benchmark.pool_roles(pool)
        children = {p.pid for p in psutil.Process().children(recursive=True)}
        assert roles["driver"] == [psutil.Process()]
        workers = [roles[f"worker {i}"][0].pid for i in range(2)]
        assert set(workers) <= children and len(set(workers)) == 2
        assert set(roles) == {"driver", "worker 0", "worker 1", "other"}
        assert all(p.pid in children and p.pid not in workers for p in roles["other"])
    bare = benchmark.BarePool(benchmark.Workload.of(FaultyEnv, 4), TIMING, 2, nodes=2)
    try:
        roles = benchmark.roles(psutil.Process(), **bare.pids)
        assert list(roles) == ["driver", "agent 0", "agent 1", "worker 0", "worker 1", "other"]
        assert [roles[f"worker {i}"][0].ppid() for i in range(2)] == bare.pids["agents"]
        assert roles["other"] == []
        layout = benchmark.Layout("bare", lambda: bare.step([0] * 4), roles)
        windows = benchmark.paired([layout], 2, 0.02)["bare"]
        assert len(windows) == 2 and set(windows[0].roles_us) == set(roles)
    finally:
        bare.close()


def test_variants_of_envfleets_runners_take_make_options() -> None:
    assert benchmark.parse_runners("process:batch_size=2, envfleet-thread:cpu_affinity=[0]") == [
        "process:batch_size=2",
        "thread:cpu_affinity=[0]",
    ]
    kind, options = benchmark.variant("process:batch_size=2:context=fork")
    assert kind.name == "process" and options == {"batch_size": 2, "context": "fork"}
    for wrong, why in (
        ("loop:x=1", "loop takes no options"),
        ("process:batch_size", "options are :key=value"),
        ("nope:x=1", "unknown runner 'nope'"),
    ):
        with pytest.raises(ValueError, match=why):
            benchmark.parse_runners(wrong)
    spec = EnvSpec.from_user(FaultyEnv)
    assert benchmark.availability("serial:batch_size=2", spec).ok
    workload = benchmark.Workload.of(FaultyEnv, 4)
    result = benchmark.measure(["serial:batch_size=2"], workload, TIMING)["serial:batch_size=2"]
    assert isinstance(result, benchmark.RunResult) and result.info["batch_size"] == 2


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


def test_the_recording_ceiling_records_what_its_vector_env_gives_alone() -> None:
    """Each process of ``vector-recording-ceiling`` acts and records as a rollout's worker: its
    columns hold the observations each action was chosen on, the actions (its policy's pick
    from the batch) and the step's rewards and flags, those of the same VectorEnv stepped alone
    with the same seed; the row goes round past RECORDED_STEPS."""
    steps, count, first = benchmark.RECORDED_STEPS + 5, 6, 3
    workload = benchmark.Workload.of("CartPole-v1", 9)
    recording, actions, venv = runners._recording_loop(workload, count, TIMING, first)
    alone = gymnasium.make_vec("CartPole-v1", count, vectorization_mode="vector_entry_point")
    try:
        obs, _ = alone.reset(seed=TIMING.seed + first)
        expected = []
        for t in range(steps):
            batch = actions[t % len(actions)]
            recording(batch)
            step = alone.step(batch)
            expected.append((obs, batch, *step[1:4]))
            obs = step[0]
        for t in (5, steps - 6, steps - 5, steps - 1):  # the last 5 went round to rows 0-4
            row = t % benchmark.RECORDED_STEPS
            for got, want in zip(recording.columns, expected[t], strict=True):
                np.testing.assert_array_equal(got[row], want)
        assert recording.columns[0].dtype == np.float32 and recording.columns[1].dtype == np.int64
        np.testing.assert_array_equal(recording.obs, obs)
    finally:
        venv.close()
        alone.close()
    runner = benchmark.CeilingRunner(workload, TIMING, recording=True)
    try:
        assert runner.name == "vector-recording-ceiling" and runner.window(0.05) > 0
    finally:
        runner.close()


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


def test_ale_hosted_steps_ale_vectors_frames_on_envfleets_workers() -> None:
    """ale-hosted's VectorEnvs, two blocks on envfleet's workers, give what ale-vector's one
    AtariVectorEnv gives for the same seed and actions (a seed per env, sticky actions
    included), frame for frame; its runner opens a worker per usable core."""
    from ale_py.vector_env import AtariVectorEnv

    spec = EnvSpec.from_user("ALE/Pong-v5")
    fns = benchmark.ale_hosted_fns(spec, 5, 2)
    assert [fn().num_envs for fn in fns] == [3, 2]
    options = benchmark.ale_vector_options(spec)
    assert options is not None
    alone = AtariVectorEnv(options.pop("game"), 5, num_threads=2, **options)
    actions = np.random.default_rng(0).integers(0, 6, size=(60, 5))
    with envfleet.make(vector_env_fns=fns, backend="process", seed=3) as pool:
        obs, _ = pool.reset(seed=3)
        want, _ = alone.reset(seed=3)
        np.testing.assert_array_equal(obs, want)
        for t, step in enumerate(actions):
            got, rewards, terminations, truncations, _ = pool.step(step)
            want, want_rewards, want_terminations, want_truncations, _ = alone.step(step)
            np.testing.assert_array_equal(got, want, err_msg=f"step {t}")
            np.testing.assert_array_equal(rewards, want_rewards)
            assert (terminations == want_terminations).all()
            assert (truncations == want_truncations).all()
    alone.close()
    runner = benchmark.RUNNERS["ale-hosted"].open(benchmark.Workload.of("ALE/Pong-v5", 4), TIMING)
    try:
        assert runner.info["workers"] == min(4, len(usable_cpus())) and runner.window(0.05) > 0
    finally:
        runner.close()


def test_hosted_rollouts_act_with_the_stepping_runners_actions_and_leave_nothing_out() -> None:
    """The rollout runner's workers act with the stepping runners' pre-sampled batches, row
    ``i`` for env ``i``, in turn (whichever worker holds the env); a window counts only what
    it handed over, and leaves no part of a rollout out (the next runner's window is its own)."""
    workload = benchmark.Workload.of("CartPole-v1", 6)
    table = np.stack(benchmark.sample_actions(workload.spec.build().action_space, 6, TIMING))
    kwargs = {"backend": "process", "num_workers": 2, "vectorization_mode": "vector_entry_point"}
    with envfleet.make("CartPole-v1", 6, **kwargs) as pool:
        policy = benchmark.CycledActions(pool.single_action_space, 6, TIMING)
        pool.reset(seed=0)
        r = pool.rollout(policy, 5)
        r2 = pool.rollout(policy, len(table))
    np.testing.assert_array_equal(r.actions, table[:5])
    np.testing.assert_array_equal(r2.actions, table[np.arange(5, 5 + len(table)) % len(table)])
    runner = benchmark.RUNNERS["hosted-rollout"].open(workload, TIMING)
    try:
        assert runner.info["workers"] == min(6, len(usable_cpus())) and runner.window(0.05) > 0
        with pytest.raises(envfleet.NoPendingError):
            runner.pool.rollout_wait(timeout=0)  # type: ignore[attr-defined]
    finally:
        runner.close()


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
    assert len(scripts) >= 6
    # The shared parser's --quick (script_parser), or an option of the script's own.
    assert {
        n for n, t in scripts.items() if "script_parser(" not in t and '"--quick"' not in t
    } == set()
    paired = paired_args(script_parser("doc", Path("x.json"), rounds=7), ["--quick"])
    assert (paired.rounds, paired.seconds) == (2, 0.2)
    args = script_parser("doc", Path("x.json")).parse_args(["--quick"])
    assert timing_from(args) == benchmark.Timing(seconds=0.5, warmup=0.3, rewarm=0.1, repeats=1)
    args = script_parser("doc", Path("x.json")).parse_args(["--quick", "--repeats", "2"])
    assert timing_from(args).repeats == 2 and timing_from(args, full=(1.0, 5)).seconds == 0.5
