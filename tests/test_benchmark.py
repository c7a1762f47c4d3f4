"""The benchmark engine's own runners: the bare pool, the parallel runner, a script's cases."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from bench.common import Case, measure_cases
from envfleet import benchmark
from envfleet.affinity import usable_cpus
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


def _counter(index: int) -> Callable[[], int]:
    return lambda: index + 1  # worker i makes i + 1 env-steps a call


def _failing(index: int) -> Callable[[], int]:
    if index == 1:
        raise KeyError("worker 1 cannot start")
    return lambda: 1


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "processes"])
def test_parallel_runner_sums_its_workers_and_reports_a_failure(threads: bool) -> None:
    runner = benchmark.ParallelRunner("par", _counter, 2, TIMING, threads=threads)
    try:
        assert runner.window(0.05) > 0
    finally:
        runner.close()
    with pytest.raises(RuntimeError, match="par worker failed: KeyError"):
        benchmark.ParallelRunner("par", _failing, 2, TIMING, threads=threads)


def _call_runner(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
    return benchmark.CallRunner("calls", lambda: 4, lambda: None, timing, answer=42)


def _refuses(workload: benchmark.Workload, timing: benchmark.Timing) -> benchmark.Runner:
    raise ValueError("not here")


def test_cases_run_through_measure_in_their_order_with_their_failures() -> None:
    cases = [
        Case("calls", _call_runner),
        Case("refuses", _refuses),
        Case("loop", benchmark.open_loop, forks=True),
        Case("calls again", functools.partial(_call_runner)),
    ]
    results = measure_cases(cases, benchmark.Workload.of(FaultyEnv, 2), TIMING)
    assert list(results) == ["calls", "refuses", "loop", "calls again"]
    assert results["refuses"] == "ValueError: not here"
    calls = results["calls"]
    assert isinstance(calls, benchmark.RunResult)
    assert calls.info == {"answer": 42} and len(calls.throughputs) == TIMING.repeats
    assert calls.setup_s >= 0
    assert all(isinstance(results[name], benchmark.RunResult) for name in ("loop", "calls again"))
