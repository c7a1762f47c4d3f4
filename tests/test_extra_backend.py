"""A backend added from outside envfleet's own list runs everything the built-in ones run.

``tests/loopback_backend.py`` is written against the contract alone (``envfleet.backends``:
``BaseTransport``, ``TransportOptions``, rows, the wire helpers) and registered here with
``envfleet.backends.register``: nothing else in envfleet names it, and ``make()``, the pool,
recovery and the error messages take it as they take the built-in backends. The equivalence
oracle (``SyncVectorEnv``, every case and autoreset mode, one and several workers, the pickled
path) and every cell of the failure matrix that applies to a backend of its capabilities run on
it, through the very helpers of ``test_equivalence.py`` and ``test_fault_matrix.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import envfleet
from envfleet.backends import HasNodes, HasSpares, LandsParts, SubmitsMany, register, unregister
from envfleet.backends.contract.registry import KINDS, kind_of
from tests import loopback_backend
from tests.envs import FaultyEnv
from tests.test_equivalence import (
    CASES,
    MODES,
    PICKLED_CASE,
    assert_same_run,
    make_pool,
    reference_run,
)
from tests.test_fault_matrix import MATRIX_FAULTS, PHASES, POLICIES, check_cell, not_applicable

LOOPBACK = register(loopback_backend.KIND).name  # now: the cells below ask its capabilities


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    register(loopback_backend.KIND)  # again, should another module have taken it out
    yield
    unregister(LOOPBACK)


def test_it_is_a_backend_once_registered() -> None:
    assert KINDS[LOOPBACK] is loopback_backend.KIND
    assert kind_of("LOOPBACK") is loopback_backend.KIND
    with envfleet.make("CartPole-v1", 4, backend=LOOPBACK, seed=0) as pool:
        assert isinstance(pool._transport, loopback_backend.LoopbackTransport)
        assert pool.num_workers == 2
        obs, _ = pool.reset()
        assert obs.shape == (4, 4)


def test_it_runs_on_the_contract_without_the_optional_capabilities() -> None:
    """None of the capabilities only some backends have: the pool copies a sync step's
    observations itself (no spares), reports one machine (no nodes) and submits a partial
    reset one command at a time (no several in one message), with the same results as the
    serial backend; closing the pool closes the transport's workers."""
    with envfleet.make("CartPole-v1", 4, backend=LOOPBACK, seed=0) as pool:
        transport = pool._transport
        workers: object = transport.workers
        assert workers is transport  # its own workers
        assert not isinstance(transport, HasSpares | HasNodes | SubmitsMany | LandsParts)
        with envfleet.make("CartPole-v1", 4, backend="serial", seed=0) as serial:
            for run in (pool, serial):
                run.reset(seed=3)
                run.reset(seed=5, options={"reset_mask": np.array([False, True, False, True])})
            actions = np.array([0, 1, 1, 0])
            for _ in range(3):
                obs, *_ = pool.step(actions)
                expected, *_ = serial.step(actions)
                np.testing.assert_array_equal(obs, expected)
                assert not np.shares_memory(obs, transport.batch.observations)
        assert pool.stats().nodes == ()
        far = transport._far  # type: ignore[attr-defined]
    assert far.groups == []  # closed through the workers' lifecycle


def test_options_it_cannot_honour_are_refused_from_its_capabilities() -> None:
    with pytest.raises(ValueError, match=r"step_timeout needs a backend that can kill a worker: "):
        envfleet.make("CartPole-v1", 2, backend=LOOPBACK, step_timeout=1.0)
    with pytest.raises(ValueError, match=r"got backend='loopback'"):
        envfleet.make("CartPole-v1", 2, backend=LOOPBACK, threads_per_worker=2)
    with pytest.raises(ValueError, match=r"address is an option of backend='ray'"):
        envfleet.make("CartPole-v1", 2, backend=LOOPBACK, address="auto")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'no_such_option'"):
        envfleet.make("CartPole-v1", 2, backend=LOOPBACK, no_such_option=1)
    with (
        envfleet.make(FaultyEnv, 2, backend=LOOPBACK) as pool,
        pytest.raises(ValueError, match=r"worker_memory_limit needs a backend that can"),
    ):
        pool.worker_memory_limit = 1 << 30


def test_a_name_is_registered_once() -> None:
    other = loopback_backend.KIND.__class__(LOOPBACK, "tests.elsewhere")
    with pytest.raises(ValueError, match="registered already"):
        register(other)
    with pytest.raises(ValueError, match="built-in"):
        unregister("process")


EQUIVALENCE_RUNS = [
    (case_name, mode, num_workers)
    for case_name in [*CASES, "TextDict"]
    for mode in MODES
    for num_workers in [1, 3]
    if not (case_name == "Pong" and num_workers == 1)  # layouts: the other cases (Pong is slow)
]


@pytest.mark.parametrize(
    ("case_name", "mode", "num_workers"),
    EQUIVALENCE_RUNS,
    ids=[f"{c}-{m.name}-{w}" for c, m, w in EQUIVALENCE_RUNS],
)
def test_matches_sync_vector_env(case_name: str, mode: AutoresetMode, num_workers: int) -> None:
    """Every row it returns crossed its wire as Rows; the values are SyncVectorEnv's."""
    case = CASES.get(case_name, PICKLED_CASE)
    reference = reference_run(case_name, mode)
    with make_pool(case, (LOOPBACK, num_workers), mode) as pool:
        assert pool.single_observation_space == reference.observation_space
        assert_same_run(reference.records, pool, case, mode, f"{case_name}/{mode.name}")


def test_async_batches_match_the_serial_backend() -> None:
    """First-ready batches smaller than the pool: the same envs, steps and values as serial."""
    runs = []
    for backend in ("serial", LOOPBACK):
        got: list[Any] = []
        with envfleet.make("CartPole-v1", 6, backend=backend, batch_size=3, seed=0) as pool:
            pool.async_reset()
            for _ in range(10):
                obs, rewards, _, _, infos = pool.recv()
                got.append((infos["env_id"].tolist(), obs.tolist(), rewards.tolist()))
                pool.send(np.ones(3, dtype=np.int64), infos["env_id"])
        runs.append(got)
    serial, loopback = runs
    per_env: list[dict[int, list[Any]]] = [{}, {}]
    for run, record in zip(runs, per_env, strict=True):
        for ids, obs, rewards in run:
            for k, i in enumerate(ids):
                record.setdefault(i, []).append((obs[k], rewards[k]))
    for i in range(6):
        steps = min(len(per_env[0].get(i, [])), len(per_env[1].get(i, [])))
        assert steps >= 1 and per_env[0][i][:steps] == per_env[1][i][:steps], i
    assert len(serial) == len(loopback)


CELLS = [
    (fault, phase, policy)
    for fault in MATRIX_FAULTS
    for phase in PHASES
    for policy in POLICIES
    if not_applicable(LOOPBACK, fault, phase, policy) is None
]


def test_the_matrix_has_cells_for_it() -> None:
    assert len(CELLS) >= 20  # env faults in every phase and policy, and a hang in close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fault", "phase", "policy"), CELLS)
def test_failure_matrix_cell(fault: str, phase: str, policy: str, tmp_path: Any) -> None:
    check_cell(LOOPBACK, fault, phase, policy, str(tmp_path))
