"""The probe behind ``envfleet tune`` and ``num_workers="auto"``."""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import pytest

import envfleet
import envfleet.affinity
from envfleet.cli.layout_timing import time_layout
from envfleet.spec import EnvSpec
from envfleet.tune import EnvProfile, Layout, auto_layout, candidate_layouts, profile_env
from tests.envs import FaultyEnv

SLEEPY = functools.partial(FaultyEnv, sleep=0.002)
ROOT = Path(__file__).resolve().parent.parent


def test_profile_tells_a_waiting_env_from_a_computing_one() -> None:
    sleepy = profile_env(EnvSpec.from_user(SLEEPY), seconds=0.1)
    assert sleepy.waits and sleepy.step_seconds >= 0.002
    cartpole = profile_env(EnvSpec.from_user("CartPole-v1"), seconds=0.1)
    assert not cartpole.waits and cartpole.step_seconds < 0.002
    assert cartpole.observation_bytes == 4 * 4


def test_auto_layout_gives_waiting_envs_a_thread_each() -> None:
    sleepy = profile_env(EnvSpec.from_user(SLEEPY), seconds=0.05)
    assert auto_layout(sleepy, "process", 8, cores=2) == Layout("process", 2, 4)
    assert auto_layout(sleepy, "thread", 8, cores=2) == Layout("thread", 8)
    cartpole = profile_env(EnvSpec.from_user("CartPole-v1"), seconds=0.05)
    assert auto_layout(cartpole, "process", 8, cores=2) == Layout("process", 2)
    assert auto_layout(cartpole, "process", 1, cores=2) == Layout("process", 1)


def _profile(cpu_share: float) -> EnvProfile:
    return EnvProfile(0.001, 1.0, 0.001, cpu_share, 16)


def test_async_pools_of_waiting_envs_get_workers_enough_for_half_a_batch_each() -> None:
    waits, computes = _profile(0.01), _profile(0.95)
    # A worker steps its envs one after another: the envs it holds come back no sooner than the
    # slowest; at most half a batch per worker, at least one worker per core, at most four.
    assert auto_layout(waits, "process", 32, cores=2, batch_size=8) == Layout("process", 8, 1, 8)
    assert auto_layout(waits, "process", 32, cores=2, batch_size=16) == Layout("process", 4, 1, 16)
    assert auto_layout(waits, "process", 32, cores=2, batch_size=2) == Layout("process", 8, 1, 2)
    assert auto_layout(waits, "process", 6, cores=2, batch_size=1) == Layout("process", 6, 1, 1)
    assert auto_layout(waits, "process", 64, cores=16, batch_size=32) == Layout(
        "process", 16, 1, 32
    )
    # Sync pools, computing envs, and remote workers keep the layouts they had.
    assert auto_layout(waits, "process", 32, cores=2, batch_size=32) == Layout("process", 2, 16)
    assert auto_layout(computes, "process", 32, cores=2, batch_size=8) == Layout("process", 2)
    assert auto_layout(waits, "ray", 32, cores=2, batch_size=8) == Layout("ray", 2, 16)
    assert auto_layout(waits, "thread", 32, cores=2, batch_size=8) == Layout("thread", 32)


def test_an_async_pool_left_to_its_defaults_is_laid_out_for_its_envs() -> None:
    cores = len(envfleet.affinity.usable_cpus())
    expected = max(min(cores, 8), min(8, 4 * cores))  # 8 envs, at most half a batch of 2 each
    with envfleet.make(SLEEPY, 8, batch_size=2, seed=0) as pool:
        assert pool.num_workers == expected
        pool.reset()
        pool.send([1] * 8)
        seen = {}
        for _ in range(4):
            obs, *_, infos = pool.recv()
            seen.update(zip(infos["env_id"].tolist(), obs.ravel().tolist(), strict=True))
        assert seen == {i: 100 * i + 1 for i in range(8)}
    # What the caller sets stays set; a sync pool keeps one worker per core.
    with envfleet.make(SLEEPY, 8, batch_size=2, num_workers=2) as pool:
        assert pool.num_workers == 2
    with envfleet.make(SLEEPY, 8, batch_size=2, threads_per_worker=2) as pool:
        assert pool.num_workers == min(cores, 8)
    with envfleet.make(SLEEPY, 8) as pool:
        assert pool.num_workers == min(cores, 8)


def _raise_in_step(env: FaultyEnv, action: Any) -> None:
    raise RuntimeError("no simulator in this process")


def test_an_async_pool_whose_env_cannot_be_timed_keeps_the_default_layout() -> None:
    """Timing the env is advice: one that fails stepping in the caller makes a pool all the
    same, and fails in its worker, named, as before."""
    cores = len(envfleet.affinity.usable_cpus())
    with envfleet.make(
        functools.partial(FaultyEnv, step_hook=_raise_in_step), 4, batch_size=2
    ) as pool:
        assert pool.num_workers == min(cores, 4)
        pool.reset()
        with pytest.raises(envfleet.EnvError, match="no simulator in this process"):
            pool.step([1, 1], env_id=[0, 1])


def test_num_workers_auto_applies_the_layout() -> None:
    with envfleet.make(SLEEPY, 6, num_workers="auto", seed=0) as pool:
        assert pool.num_workers == min(len(envfleet.affinity.usable_cpus()), 6)
        pool.reset()
        obs = pool.step([1] * 6)[0]
        assert obs.ravel().tolist() == [100 * i + 1 for i in range(6)]


def test_candidates_run_and_describe_themselves() -> None:
    spec = EnvSpec.from_user("CartPole-v1")
    profile = profile_env(spec, seconds=0.05)
    layouts = candidate_layouts(profile, 8, cores=2)
    assert len(layouts) == len(set(layouts)) >= 4
    assert any(layout.batch_size == 4 for layout in layouts)
    timed = time_layout(spec, 8, Layout("process", 2, batch_size=4), seconds=0.2)
    assert timed.steps_per_second > 0 and timed.steps_per_env >= 5 and timed.seconds >= 0.2
    line = Layout("process", 2, batch_size=4).describe("CartPole-v1", 8)
    assert line == "envfleet.make('CartPole-v1', 8, backend='process', num_workers=2, batch_size=4)"


def test_waiting_envs_also_get_pinned_candidates_and_computing_ones_do_not() -> None:
    spec = EnvSpec.from_user(SLEEPY)
    sleepy = profile_env(spec, seconds=0.05)
    layouts = candidate_layouts(sleepy, 8, cores=2)
    last = max(os.sched_getaffinity(0))
    pinned = Layout("thread", 8, cpu_affinity=(last,))
    assert pinned in layouts
    assert Layout("process", 2, 4, cpu_affinity="spread") in layouts
    assert pinned.describe("Sleepy", 8) == (
        f"envfleet.make('Sleepy', 8, backend='thread', num_workers=8, cpu_affinity=[{last}])"
    )
    assert time_layout(spec, 4, Layout("thread", 4, cpu_affinity=(last,)), 0.1).steps_per_second > 0
    # The same env had it computed (a short probe of CartPole on a loaded machine can read as
    # waiting, so the profile is given rather than probed).
    computing = dataclasses.replace(sleepy, cpu_share=1.0)
    assert all(layout.cpu_affinity is None for layout in candidate_layouts(computing, 8, cores=2))


def test_the_probe_module_never_imports_the_pool() -> None:
    """``envfleet.tune`` (imported by ``make`` for ``num_workers="auto"``) imports neither
    ``envfleet._make`` nor the pool, not even lazily: timing layouts lives with the CLI."""
    tree = ast.parse((ROOT / "envfleet" / "tune.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    envfleet_modules = {m for m in imported if m and m.startswith("envfleet")}
    # backends.registry: the backends' capabilities, which the layout asks (no pool there).
    allowed = {"envfleet.affinity", "envfleet.spec", "envfleet.backends.contract.registry"}
    assert envfleet_modules <= allowed, envfleet_modules


def test_an_env_with_a_vector_entry_point_adds_hosted_layouts() -> None:
    """CartPole-v1 has Gymnasium's numpy VectorEnv: tune times it hosted (one worker, one per
    core) beside the single-env layouts; an id with none, or a factory, adds nothing."""
    from envfleet.tune import has_vector_entry_point

    assert has_vector_entry_point(EnvSpec.from_user("CartPole-v1"))
    assert not has_vector_entry_point(EnvSpec.from_user("FrozenLake-v1"))
    assert not has_vector_entry_point(EnvSpec.from_user(functools.partial(len, [])))
    profile = _profile(cpu_share=1.0)
    hosted = [
        layout
        for layout in candidate_layouts(profile, 8, cores=2, hosted=True)
        if layout.vectorization_mode == "vector_entry_point"
    ]
    assert [(h.backend.value, h.num_workers) for h in hosted] == [("serial", 1), ("process", 2)]
    assert hosted[1].make_kwargs()["vectorization_mode"] == "vector_entry_point"
    assert not any(layout.vectorization_mode for layout in candidate_layouts(profile, 8, cores=2))
