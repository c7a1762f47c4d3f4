"""The failure matrix of ``test_fault_matrix.py`` on the ray backend, on one local Ray.

Ray takes seconds to start and each pool seconds to place its actors, so this module joins one
Ray for all its cells and runs a sample of the table (``test_ray.py`` covers more of the step
phase: env exceptions, dead and hung actors): each env fault in the step phase, then a cell or
two of every other phase and of ``"restart"``, each kind of fault (an env's exception, a dead
actor, a stuck one) somewhere. The cells run the checks of the other backends
(:func:`check_cell`); Ray's daemons are children of this process, so the leak check is
:func:`ray_leak_check`, which still fails a cell that leaves an actor behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from tests import matrix_hooks as hooks  # noqa: E402
from tests.ray_helpers import ray_leak_check  # noqa: E402
from tests.test_fault_matrix import check_cell, not_applicable  # noqa: E402

CELLS = (
    [("step", fault, "raise") for fault in hooks.ENV_FAULTS]
    + [("step", "broken_str", "restart"), ("make", "base_exception", "raise")]
    + [
        ("reset", "exit", "restart"),
        ("call", "unpicklable", "raise"),
        ("call", "segfault", "raise"),
    ]
    + [("close", "hang", "raise"), ("rebuild", "raise", "restart"), ("rebuild", "hang", "restart")]
)


@pytest.fixture(autouse=True)
def no_leaked_processes_or_shared_memory() -> Iterator[None]:
    """Overrides conftest.py's: Ray's daemons outlive tests, envfleet's actors must not."""
    yield from ray_leak_check()


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("phase", "fault", "policy"), CELLS, ids=[f"{f}-{ph}-{po}" for ph, f, po in CELLS]
)
def test_ray_cell(ray_session: None, phase: str, fault: str, policy: str, tmp_path: Any) -> None:
    assert not_applicable("ray", fault, phase, policy) is None
    check_cell("ray", fault, phase, policy, str(tmp_path))
