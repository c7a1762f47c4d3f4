"""``envfleet.registration.register_vector``: ``gymnasium.make_vec`` hands out envfleet pools."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from envfleet.caller_registry import CallerRegistry
from envfleet.registration import register_vector
from tests.envs import FaultyEnv
from tests.legacy_envs import OldApiCounterEnv

VECTOR = "vector_entry_point"


@pytest.fixture
def ids() -> Iterator[list[str]]:
    """Ids a test registers, removed from Gymnasium's registry afterwards."""
    registered: list[str] = []
    yield registered
    for env_id in registered:
        gymnasium.registry.pop(env_id, None)


def test_an_id_target_gives_a_pool_like_the_base_env(ids: list[str]) -> None:
    ids.append("envfleet-test/CartPole-v1")
    spec = register_vector("envfleet-test/CartPole-v1", "CartPole-v1", backend="serial")
    assert spec.max_episode_steps == 500  # taken from CartPole-v1's spec
    with gymnasium.make_vec("envfleet-test/CartPole-v1", 3, vectorization_mode=VECTOR) as pool:
        assert isinstance(pool, envfleet.Pool)
        assert pool.num_envs == 3
        assert pool.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
        assert pool.spec is not None and pool.spec.id == "envfleet-test/CartPole-v1"
        obs, _ = pool.reset(seed=3)
    reference = gymnasium.make_vec("CartPole-v1", 3, vectorization_mode="sync")
    np.testing.assert_array_equal(obs, reference.reset(seed=3)[0])
    assert pool.single_observation_space == reference.single_observation_space
    reference.close()
    # gymnasium.make still builds one env of the base id.
    single = gymnasium.make("envfleet-test/CartPole-v1")
    assert single.unwrapped.__class__.__name__ == "CartPoleEnv"
    single.close()


def test_make_vec_kwargs_split_into_pool_options_and_env_kwargs(ids: list[str]) -> None:
    ids.append("envfleet-test/Pendulum-v1")
    register_vector("envfleet-test/Pendulum-v1", "Pendulum-v1", backend="serial")
    with gymnasium.make_vec(
        "envfleet-test/Pendulum-v1",
        4,
        vectorization_mode=VECTOR,
        backend="process",
        num_workers=2,
        seed=5,
        autoreset_mode=AutoresetMode.SAME_STEP,
        g=3.0,  # Pendulum's gravity: an env kwarg
        max_episode_steps=2,
    ) as pool:
        assert "workers=2" in repr(pool)
        assert pool.autoreset_mode is AutoresetMode.SAME_STEP
        assert pool.get_attr("g") == (3.0,) * 4
        obs, _ = pool.reset()  # the pool's seed: env i gets 5 + i
        pool.step(np.zeros((4, 1), np.float32))
        _, _, terminated, truncated, infos = pool.step(np.zeros((4, 1), np.float32))
    assert truncated.all() and not terminated.any() and infos["_final_obs"].all()
    reference = gymnasium.make("Pendulum-v1")
    np.testing.assert_allclose(obs[2], reference.reset(seed=7)[0])
    reference.close()


def test_a_factory_target_with_a_time_limit(ids: list[str]) -> None:
    ids.append("envfleet-test/LegacyCounter-v0")
    register_vector(
        "envfleet-test/LegacyCounter-v0", OldApiCounterEnv, max_episode_steps=2, backend="serial"
    )
    with gymnasium.make_vec("envfleet-test/LegacyCounter-v0", 2, vectorization_mode=VECTOR) as pool:
        pool.reset(seed=0)
        pool.step(np.array([0, 1]))
        _, _, terminated, truncated, _ = pool.step(np.array([0, 1]))
    assert truncated.tolist() == [True, True] and not terminated.any()
    # The single-env entry point builds the (converted) factory env with the same time limit.
    single = gymnasium.make("envfleet-test/LegacyCounter-v0")
    single.reset(seed=0)
    single.step(0)
    assert single.step(0)[3] is True
    single.close()


def test_an_existing_id_keeps_its_env_and_gets_an_envfleet_vector_entry_point(
    ids: list[str],
) -> None:
    ids.append("envfleet-test/Acrobot-v1")
    gymnasium.register(
        "envfleet-test/Acrobot-v1",
        entry_point="gymnasium.envs.classic_control.acrobot:AcrobotEnv",
        max_episode_steps=500,
    )
    register_vector("envfleet-test/Acrobot-v1", backend="serial", num_workers=1)
    with gymnasium.make_vec("envfleet-test/Acrobot-v1", 2, vectorization_mode=VECTOR) as pool:
        assert isinstance(pool, envfleet.Pool)
        assert pool.single_action_space == gymnasium.spaces.Discrete(3)
    spec = gymnasium.spec("envfleet-test/Acrobot-v1")
    assert spec.entry_point == "gymnasium.envs.classic_control.acrobot:AcrobotEnv"
    assert spec.max_episode_steps == 500
    # Without a mode, make_vec prefers the vector entry point.
    with gymnasium.make_vec("envfleet-test/Acrobot-v1", 2) as pool:
        assert isinstance(pool, envfleet.Pool)


def test_bad_registrations_are_refused() -> None:
    with pytest.raises(ValueError, match="not registered"):
        register_vector("envfleet-test/Nothing-v0")
    with pytest.raises(ValueError, match=r"unknown envfleet\.make options"):
        register_vector("envfleet-test/Nothing-v0", "CartPole-v1", gravity=1.0)
    assert "envfleet-test/Nothing-v0" not in gymnasium.registry


def test_torchrl_accepts_the_pool(ids: list[str]) -> None:
    pytest.importorskip("torchrl")
    from torchrl.envs import GymWrapper

    ids.append("envfleet-test/CartPole-v1")
    register_vector(
        "envfleet-test/CartPole-v1",
        "CartPole-v1",
        backend="serial",
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    pool = gymnasium.make_vec("envfleet-test/CartPole-v1", 4, vectorization_mode=VECTOR)
    env = GymWrapper(pool)
    try:
        rollout = env.rollout(300, break_when_any_done=False)
        assert tuple(rollout.batch_size) == (4, 300)
        assert rollout["next", "done"].any()  # episodes ended and were reset inside the pool
        assert rollout["next", "reward"].sum().item() == 4 * 300
    finally:
        env.close()
    assert pool.closed
    next_step = envfleet.make("CartPole-v1", 2, backend="serial")
    with next_step, pytest.raises(RuntimeError, match="SAME_STEP or DISABLED"):
        GymWrapper(next_step)  # TorchRL reads the pool's autoreset_mode


CALLER_IDS = {
    "envfleet-test/CallerString-v0": "tests.envs:FaultyEnv",  # an entry point named by a string
    "envfleet-test/CallerClass-v0": FaultyEnv,  # and one given as a class
}


def _make_caller_string_id() -> gymnasium.Env[Any, Any]:
    return gymnasium.make("envfleet-test/CallerString-v0")


def _make_caller_class_id() -> gymnasium.Env[Any, Any]:
    return gymnasium.make("envfleet-test/CallerClass-v0", episode_length=2)


def check_caller_ids_inside_factories(**make_kwargs: Any) -> None:
    """Factories calling ``gymnasium.make`` on ids registered only in this process (after
    import, so a fresh worker importing this module lacks them) build in every worker as in
    SyncVectorEnv, time limits included. Registered and unregistered here."""
    for env_id, entry_point in CALLER_IDS.items():
        gymnasium.register(env_id, entry_point=entry_point, max_episode_steps=3)
    try:
        env_fns = [_make_caller_string_id, _make_caller_class_id] * 2
        reference = SyncVectorEnv(env_fns)
        with envfleet.make(env_fns, seed=5, **make_kwargs) as pool:
            got, want = pool.reset(), reference.reset(seed=5)
            np.testing.assert_array_equal(got[0], want[0])
            actions = np.ones(4, dtype=np.int64)
            for step in range(6):
                got, want = pool.step(actions), reference.step(actions)
                for a, b in zip(got[:4], want[:4], strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
            assert pool.get_attr("spec")[1].id == "envfleet-test/CallerClass-v0"
        reference.close()
    finally:
        for env_id in CALLER_IDS:
            gymnasium.registry.pop(env_id, None)


@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_ids_registered_in_the_caller_build_inside_factories(context: str) -> None:
    check_caller_ids_inside_factories(backend="process", num_workers=2, context=context)


def _make_my_cartpole() -> gymnasium.Env[Any, Any]:
    return gymnasium.make("envfleet-test/MyCartPole-v0")


def _make_cartpole() -> gymnasium.Env[Any, Any]:
    return gymnasium.make("CartPole-v1")


@contextlib.contextmanager
def gymnasium_classes_under_caller_ids() -> Iterator[None]:
    """A new id whose entry point is Gymnasium's own CartPole (time limit 7), and CartPole-v1
    registered again with a time limit of 5; both undone afterwards."""
    original = gymnasium.spec("CartPole-v1")
    gymnasium.register(
        "envfleet-test/MyCartPole-v0",
        entry_point="gymnasium.envs.classic_control:CartPoleEnv",
        max_episode_steps=7,
    )
    gymnasium.registry["CartPole-v1"] = dataclasses.replace(original, max_episode_steps=5)
    try:
        yield
    finally:
        gymnasium.registry["CartPole-v1"] = original
        gymnasium.registry.pop("envfleet-test/MyCartPole-v0", None)


def check_gymnasium_classes_under_caller_ids(**make_kwargs: Any) -> None:
    """Factories calling ``gymnasium.make`` on ids whose entry point is Gymnasium's own class
    build in every worker what they build here (as in SyncVectorEnv): the new id exists there,
    and CartPole-v1 has this process's time limit, not Gymnasium's."""
    with gymnasium_classes_under_caller_ids():
        env_fns = [_make_my_cartpole, _make_cartpole] * 2
        reference = SyncVectorEnv(env_fns)
        first_truncated: dict[int, int] = {}
        with envfleet.make(env_fns, seed=5, **make_kwargs) as pool:
            got, want = pool.reset(), reference.reset(seed=5)
            np.testing.assert_array_equal(got[0], want[0])
            for step in range(1, 9):
                actions = np.full(4, step % 2, dtype=np.int64)  # balanced: no termination
                got, want = pool.step(actions), reference.step(actions)
                for a, b in zip(got[:4], want[:4], strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
                for i in np.flatnonzero(got[3]).tolist():
                    first_truncated.setdefault(i, step)
            assert pool.get_attr("spec")[0].id == "envfleet-test/MyCartPole-v0"
        reference.close()
    assert first_truncated == {0: 7, 1: 5, 2: 7, 3: 5}


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_ids_with_gymnasiums_own_entry_points_build_inside_factories(context: str) -> None:
    check_gymnasium_classes_under_caller_ids(backend="process", num_workers=2, context=context)


def test_only_entries_that_differ_from_a_fresh_registry_travel() -> None:
    """Gymnasium's own entries, as ``import gymnasium`` makes them, stay behind (a fresh
    worker has them); one registered again with other fields, or a new id with Gymnasium's
    class, travels."""
    travelling = {spec.id for spec in CallerRegistry.snapshot().entries}
    # Not GymV26Environment-v0: importing shimmy (as the legacy-gym tests do in this process)
    # registers it again with shimmy's entry point, which then rightly travels.
    own = {"CartPole-v1", "Pendulum-v1", "FrozenLake-v1", "Acrobot-v1"}
    assert own <= set(gymnasium.registry) and not own & travelling
    with gymnasium_classes_under_caller_ids():
        travelling = {spec.id for spec in CallerRegistry.snapshot().entries}
    assert {"CartPole-v1", "envfleet-test/MyCartPole-v0"} <= travelling
    assert not (own - {"CartPole-v1"}) & travelling


def test_an_entry_a_worker_cannot_import_stays_behind_and_the_others_arrive(
    tmp_path: Any,
) -> None:
    """An id registered from a module the worker cannot import (the caller's own, here one
    only this process has on its path) does not keep the registry from arriving: the worker
    gets the other entries and builds its envs (a Ray client's workers, say, have no test
    suite on their path)."""
    import importlib
    import pickle
    import subprocess
    import sys
    import textwrap

    module = tmp_path / "only_here_envs.py"
    module.write_text(
        "import gymnasium\nclass OnlyHere(gymnasium.Env):\n    pass\n", encoding="utf-8"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        # Made above, in tmp_path: a module only this process can import, not a dependency.
        only_here = importlib.import_module("only_here_envs")
        gymnasium.register("envfleet-test/OnlyHere-v0", entry_point=only_here.OnlyHere)
        gymnasium.register(
            "envfleet-test/Travels-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv"
        )
        blob = pickle.dumps(CallerRegistry.snapshot())
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("envfleet-test/OnlyHere-v0", "envfleet-test/Travels-v0"):
            gymnasium.registry.pop(name, None)
        sys.modules.pop("only_here_envs", None)
    script = textwrap.dedent(
        """
        import pickle, sys
        registry = pickle.loads(sys.stdin.buffer.read())
        print(sorted(s.id for s in registry.entries if s.id.startswith("envfleet-test/")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=blob, capture_output=True, timeout=120, check=True
    )
    assert done.stdout.decode().strip() == "['envfleet-test/Travels-v0']"
