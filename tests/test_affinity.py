"""``cpu_affinity``: workers really run on the CPUs asked for, bad values fail clearly, and
pinned pools step exactly like unpinned ones."""

from __future__ import annotations

import os
import re
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import envfleet
from envfleet.affinity import check_affinity, cpus_for, usable_cpus
from tests.conftest import WORKER_BACKENDS

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux feature"
)


class AffinityEnv(gym.Env[np.ndarray, int]):
    """CartPole whose ``cpus()`` says which CPUs the calling thread may run on."""

    def __init__(self) -> None:
        self.inner = gym.make("CartPole-v1")
        self.observation_space = self.inner.observation_space
        self.action_space = self.inner.action_space

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        return self.inner.reset(**kwargs)  # type: ignore[no-any-return]

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self.inner.step(action)  # type: ignore[no-any-return]

    def cpus(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))


def last_cpu() -> int:
    return usable_cpus()[-1]


@pytest.mark.parametrize("worker_backend", WORKER_BACKENDS)
def test_every_worker_runs_on_the_cpus_given(worker_backend: str) -> None:
    cpu = last_cpu()
    before = os.sched_getaffinity(0)
    with envfleet.make(
        AffinityEnv, 4, backend=worker_backend, num_workers=2, cpu_affinity=[cpu]
    ) as pool:
        pool.reset(seed=0)
        assert pool.call("cpus") == ([cpu],) * 4
    assert os.sched_getaffinity(0) == before  # the caller's thread is never pinned


@pytest.mark.parametrize("worker_backend", WORKER_BACKENDS)
def test_per_worker_sets_cycle_and_spread(worker_backend: str) -> None:
    usable = usable_cpus()
    per_worker = [[usable[0]], [usable[-1]]]
    with envfleet.make(
        AffinityEnv, 6, backend=worker_backend, num_workers=3, cpu_affinity=per_worker
    ) as pool:
        # workers hold envs [0, 1], [2, 3], [4, 5]; worker w gets entry w % 2
        expected = [per_worker[w % 2] for w in (0, 0, 1, 1, 2, 2)]
        assert list(pool.call("cpus")) == expected
    with envfleet.make(
        AffinityEnv, 3, backend=worker_backend, num_workers=3, cpu_affinity="spread"
    ) as pool:
        assert list(pool.call("cpus")) == [[usable[w % len(usable)]] for w in range(3)]


def test_threads_of_a_worker_inherit_its_cpus() -> None:
    cpu = last_cpu()
    with envfleet.make(
        AffinityEnv, 4, backend="process", num_workers=1, threads_per_worker=2, cpu_affinity=[cpu]
    ) as pool:
        pool.reset(seed=0)
        assert pool.call("cpus") == ([cpu],) * 4


def test_no_pinning_by_default() -> None:
    with envfleet.make(AffinityEnv, 2, backend="thread") as pool:
        assert pool.call("cpus") == (sorted(os.sched_getaffinity(0)),) * 2


@pytest.mark.parametrize("worker_backend", WORKER_BACKENDS)
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_pinned_trajectories_match_serial(worker_backend: str, mode: str) -> None:
    num_envs, steps = 5, 120
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, size=(steps, num_envs))
    results = []
    for kwargs in (
        {"backend": "serial"},
        {"backend": worker_backend, "num_workers": 2, "cpu_affinity": [last_cpu()]},
    ):
        with envfleet.make("CartPole-v1", num_envs, seed=3, autoreset_mode=mode, **kwargs) as pool:
            trajectory = [pool.reset()[0]]
            for a in actions:
                obs, rewards, terms, truncs, _ = pool.step(a)
                trajectory += [obs, rewards, terms, truncs]
            results.append(trajectory)
    for ours, reference in zip(results[1], results[0], strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_unusable_cpu_names_value_and_usable_cpus() -> None:
    usable = usable_cpus()
    bad = max(usable) + 1000
    words = re.escape(f"CPUs [{bad}]") + ".*" + re.escape(f"usable CPUs: {list(usable)}")
    with pytest.raises(ValueError, match=words):
        envfleet.make("CartPole-v1", 2, backend="thread", cpu_affinity=[bad])


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("pack", ValueError, "'pack' is not understood"),
        ([], ValueError, "names no CPU"),
        ([[0], []], ValueError, "empty CPU set"),
        ([-1], ValueError, "CPU ids are >= 0"),
        ([0.5], TypeError, "CPU ids must be ints"),
        ([True], TypeError, "CPU ids must be ints"),
        (3, TypeError, "must be None, 'spread'"),
        ([[0], 1], TypeError, "must be None, 'spread'"),
    ],
)
def test_bad_values_raise_clear_errors(value: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=re.escape(words)):
        envfleet.make("CartPole-v1", 2, backend="thread", cpu_affinity=value)  # type: ignore[arg-type]


def test_serial_backend_refuses_pinning() -> None:
    with pytest.raises(ValueError, match="cpu_affinity needs a backend with workers to pin"):
        envfleet.make("CartPole-v1", 2, backend="serial", cpu_affinity=[0])


def test_normalised_forms() -> None:
    assert check_affinity(None) is None
    assert check_affinity("spread") == "spread"
    cpu = usable_cpus()[0]
    assert check_affinity([cpu, cpu]) == ((cpu,),)
    assert check_affinity({cpu}) == ((cpu,),)
    assert check_affinity([[cpu], (cpu,)]) == ((cpu,), (cpu,))
    assert check_affinity([9999], check_usable=False) == ((9999,),)
    assert cpus_for("spread", 5, (0, 1)) == (1,)
    assert cpus_for(((0,), (1, 2)), 3, (0, 1, 2)) == (1, 2)
