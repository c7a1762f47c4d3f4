"""Spare observation rows (``envfleet.backends.contract.spares``): a sync step with
``copy=True`` hands out the block the workers copied its frames into, never one the caller still
holds, with the values Gymnasium's ``SyncVectorEnv`` gives; a step whose rows did not all come
plainly copies."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
from envfleet.backends.contract import spares as spares_module
from envfleet.backends.contract.spares import Spares
from tests import faults
from tests.envs import FaultyEnv, FramesEnv
from tests.test_equivalence import assert_same

NUM_ENVS = 6
STEPS = 30


def spare_of(pool: envfleet.Pool, obs: np.ndarray) -> int | None:
    """Which of the pool's spares ``obs`` is a view of (``None``: a copy of its own)."""
    spares = pool._transport.spares
    assert isinstance(spares, Spares)
    for k, array in enumerate(spares._arrays):
        if obs.base is array:
            return k
    return None


def frames_pool(mode: AutoresetMode = AutoresetMode.NEXT_STEP, **kwargs: Any) -> envfleet.Pool:
    return envfleet.make(
        FramesEnv, NUM_ENVS, backend="process", num_workers=2, autoreset_mode=mode, **kwargs
    )


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_spared_steps_match_sync_vector_env_while_the_caller_keeps_and_changes_arrays(
    mode: AutoresetMode,
) -> None:
    reference = SyncVectorEnv([FramesEnv] * NUM_ENVS, autoreset_mode=mode)
    pool = frames_pool(mode)
    kept: list[tuple[np.ndarray, np.ndarray]] = []  # (what the pool gave, its value then)
    spared = 0
    try:
        want, got = reference.reset(seed=7), pool.reset(seed=7)
        np.testing.assert_array_equal(got[0], want[0])
        rng = np.random.default_rng(0)
        for t in range(STEPS):
            actions = rng.integers(0, 3, NUM_ENVS)
            want, got = reference.step(actions), pool.step(actions)
            for w, g in zip(want[:4], got[:4], strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"step {t}")
                assert g.dtype == w.dtype
            obs = got[0]
            spared += spare_of(pool, obs) is not None
            for old, _ in kept:  # a spare the caller holds is never handed out again
                assert not np.shares_memory(obs, old), f"step {t}"
            if t in (0, 20):
                kept.append((obs[1:4], obs[1:4].copy()))  # a slice keeps its spare held
            elif t % 4 == 0:
                obs[:] = 0  # the caller's own array: the envs' rows do not change with it
            ended = got[2] | got[3]
            if mode is AutoresetMode.DISABLED and ended.any():
                want_r = reference.reset(options={"reset_mask": ended.copy()})
                got_r = pool.reset(options={"reset_mask": ended.copy()})
                np.testing.assert_array_equal(got_r[0], want_r[0])
        for held, value in kept:
            np.testing.assert_array_equal(held, value)
        # Two spares: one held since step 0; the other handed out every other step (this loop
        # holds the last observations while the next step runs) until kept at step 20 or 21.
        assert spared >= STEPS // 3
    finally:
        pool.close()
        reference.close()


def test_every_spare_held_the_step_copies() -> None:
    pool = frames_pool()
    try:
        pool.reset(seed=1)
        actions = np.zeros(NUM_ENVS, dtype=np.int64)
        first = pool.step(actions)[0]
        second = pool.step(actions)[0]
        assert {spare_of(pool, first), spare_of(pool, second)} == {0, 1}
        values = first.copy(), second.copy()
        third = pool.step(actions)[0]
        assert spare_of(pool, third) is None  # both held: a copy
        del first
        fourth = pool.step(actions)[0]
        assert spare_of(pool, fourth) is not None  # the first one's spare is free again
        np.testing.assert_array_equal(second, values[1])
        assert not np.shares_memory(fourth, second) and not np.shares_memory(fourth, third)
    finally:
        pool.close()


def no_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spares_module, "MIN_BYTES", 1 << 62)


def run(pool: envfleet.Pool, steps: int) -> list[Any]:
    out: list[Any] = [pool.reset()]  # seeds from make(seed=...): restarts reseed alike
    for t in range(steps):
        out.append(pool.step(np.full(NUM_ENVS, t % 3)))
    return out


@pytest.mark.parametrize("hook", ["exit_in_step", "raise_value_error_in_step"])
def test_a_step_restarting_envs_matches_the_pool_without_spares(
    hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker lost mid-step (its envs restarted) and an env that raises: the spared pool
    gives what the same pool without spares gives, step for step."""
    factory = functools.partial(FramesEnv, getattr(faults, hook))
    options: dict[str, Any] = {"num_workers": 2, "on_error": "restart", "seed": faults.SEED}
    spared = envfleet.make(factory, NUM_ENVS, backend="process", **options)
    try:
        got = run(spared, 2 * faults.FAIL_AT_STEP + 3)
        assert spared.stats().restarts >= 1
    finally:
        spared.close()
    no_spares(monkeypatch)
    plain = envfleet.make(factory, NUM_ENVS, backend="process", **options)
    try:
        assert plain._dispatch.spares is None
        want = run(plain, 2 * faults.FAIL_AT_STEP + 3)
    finally:
        plain.close()
    assert_same(want, got)


def armed(pool: envfleet.Pool) -> int:
    spares = pool._transport.spares
    assert isinstance(spares, Spares)
    return int(spares._word[0])


def test_a_step_that_raises_leaves_nothing_armed() -> None:
    """An env that raises (on_error="raise") and a caller's bad actions: no spare stays armed
    (no worker copies rows after a later command), and the pool goes on handing out spares."""
    factory = functools.partial(FramesEnv, faults.raise_value_error_in_step)
    pool = envfleet.make(factory, NUM_ENVS, backend="process", num_workers=2)
    try:
        pool.reset(seed=faults.SEED)
        with pytest.raises(ValueError, match="boom in step"):
            for _ in range(faults.FAIL_AT_STEP):
                pool.step(np.zeros(NUM_ENVS, dtype=np.int64))
        assert armed(pool) == 0
    finally:
        pool.close()
    reference = SyncVectorEnv([FramesEnv] * NUM_ENVS)
    pool = frames_pool()
    try:
        pool.reset(seed=2)
        reference.reset(seed=2)
        with pytest.raises(ValueError, match="action"):
            pool.step(np.zeros(NUM_ENVS + 1, dtype=np.int64))
        assert armed(pool) == 0
        for t in range(3):
            actions = np.full(NUM_ENVS, t % 3)
            want, got = reference.step(actions), pool.step(actions)
            assert_same(want[:4], got[:4])
            assert spare_of(pool, got[0]) is not None
            assert armed(pool) == 0
    finally:
        pool.close()
        reference.close()


@pytest.mark.parametrize(
    ("env", "kwargs"),
    [
        (FramesEnv, {"copy": False}),  # views of the batch: nothing to copy
        (FramesEnv, {"backend": "thread"}),  # no worker processes
        (FaultyEnv, {}),  # a batch below MIN_BYTES: the pool's copy costs less
    ],
    ids=["copy-false", "thread", "small"],
)
def test_no_spares_where_they_save_nothing(env: Any, kwargs: dict[str, Any]) -> None:
    pool = envfleet.make(env, NUM_ENVS, **{"backend": "process", "num_workers": 2, **kwargs})
    try:
        assert pool._dispatch.spares is None  # none kept, or a transport that keeps none
        pool.reset(seed=0)
        assert pool.step(np.zeros(NUM_ENVS, dtype=np.int64))[0].shape[0] == NUM_ENVS
    finally:
        pool.close()


def test_spare_sizes() -> None:
    box = FramesEnv().observation_space
    per_env = int(np.prod(box.shape))
    assert spares_module.spare_bytes(box, 1) == 0  # 12 KB: the pool's copy is cheap
    assert spares_module.spare_bytes(box, NUM_ENVS) == NUM_ENVS * per_env
    too_many = spares_module.MAX_BYTES // per_env  # SPARES blocks of it would pass the cap
    assert spares_module.spare_bytes(box, too_many) == 0


def test_the_spares_lifecycle() -> None:
    """Armed, handed out, held, spoiled: what the pool reads of a :class:`Spares`."""
    import multiprocessing

    box = FramesEnv().observation_space
    raw = spares_module.allocate(box, NUM_ENVS, multiprocessing.get_context())
    spares = Spares(box, NUM_ENVS, raw)
    assert spares.hand_out() is None  # nothing armed
    spares.arm()
    assert spares._word[0] == 1
    first = spares.hand_out()
    assert first is not None and spares._word[0] == 0
    spares.arm()  # spare 0 is held (first): spare 1
    assert spares._word[0] == 2
    spares.spoil()  # e.g. a worker lost mid-step: its rows may not be in the spare
    assert spares.hand_out() is None and spares._word[0] == 0
    spares.arm()
    second = spares.hand_out()
    assert second is not None and not np.shares_memory(first, second)
    spares.arm()  # both held: nothing armed
    assert spares._word[0] == 0 and spares.hand_out() is None
    del first
    spares.arm()
    assert spares._word[0] == 1
