"""Shared fixtures: leak checks after every test and the backends every test runs on.

Add a backend (``"thread"``, ``"ray"``) to :data:`BACKENDS`; if it runs envs on several workers,
to :data:`WORKER_BACKENDS` too, and if those workers are other processes, to
:data:`PROCESS_BACKENDS`. Every test taking ``backend`` or ``pool_config`` then picks it up.
"""

from __future__ import annotations

import gc
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

BACKENDS = ("serial", "thread", "process")
"""Every backend; tests taking the ``backend`` fixture run once per entry."""

WORKER_BACKENDS = ("thread", "process")
"""Backends whose envs are split over ``num_workers`` workers (the others ignore it)."""

PROCESS_BACKENDS = ("process",)
"""Worker backends whose workers are other processes (a worker may ``os._exit``; own pids)."""

WORKER_COUNTS = (1, 2, 3)
"""Worker counts the equivalence tests try (with 7 envs: blocks of 7; 4+3; 3+2+2)."""

POOL_CONFIGS = [(b, None) for b in BACKENDS if b not in WORKER_BACKENDS] + [
    (b, w) for b in WORKER_BACKENDS for w in WORKER_COUNTS
]
"""``(backend, num_workers)`` pairs for tests taking the ``pool_config`` fixture."""

SHM = "/dev/shm"
SHM_GRACE = 1.0
"""Seconds a new ``/dev/shm`` entry may take to go before it counts as left behind."""
CHILD_EXIT_GRACE = 3.0


@pytest.fixture(autouse=True, scope="session")
def _sb3_logs_under_pytests_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SB3's logger makes a folder ``SB3-<date>`` in the system's temp dir for each model
    unless ``SB3_LOGDIR`` names one: the suite's go under pytest's own temp dir instead of
    staying behind in ``/tmp`` (subprocesses inherit it)."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))
    yield


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:  # a module may name its own (``BACKENDS_HERE``)
        metafunc.parametrize("backend", getattr(metafunc.module, "BACKENDS_HERE", BACKENDS))
    if "pool_config" in metafunc.fixturenames:
        ids = [b if w is None else f"{b}-w{w}" for b, w in POOL_CONFIGS]
        metafunc.parametrize("pool_config", POOL_CONFIGS, ids=ids)


RAY_MODULES = frozenset(
    {
        "test_ray.py",
        "test_ray_nodes.py",
        "test_ray_cluster.py",
        "test_fault_matrix_ray.py",
        "test_node_door.py",
        "test_ray_client.py",
        "test_rollout_nodes.py",
        "test_ppo_rollouts.py",
    }
)
"""Modules that run a Ray (or a cluster of several nodes) in pytest's process for the module."""


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (``make test`` runs two workers)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How ``pytest -n`` hands tests to its workers: the Ray modules go whole to one worker, one
    after another, so each starts its Ray (or cluster) once, its first test still runs before
    that Ray starts, and no two Rays run at once (test_ray_nodes took 2.6 times as long beside
    test_ray on the other worker); every other test goes alone to whichever worker is free."""
    if config.getvalue("dist") != "load":  # a --dist of the caller's choice: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayModulesWhole(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if module.rpartition("/")[2] in RAY_MODULES else nodeid

    return RayModulesWhole(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built (the modules, torch's and Ray's included) out of the
    collector's sight: the leak checks' ``gc.collect()`` after every test then scans only what
    tests made since, not some 300,000 long-lived objects each time (0.1 s a test, minutes a
    run). Pools are made by tests, after this point, so they are still collected (the leak
    check does the same after each test: see :func:`no_leaked_processes_or_shared_memory`)."""
    gc.collect()
    gc.freeze()


def _helpers() -> dict[str, object]:
    """multiprocessing's own long-lived helper processes, by name (``None``: absent).

    The resource tracker starts with the first spawn/forkserver semaphore, the fork server with
    the first forkserver process; both then live as long as this process. Their private
    attributes are the only way to know their pids, and ``_stop()`` (which CPython's own tests
    use) the only way to stop them.
    """
    return {
        "resource tracker": getattr(multiprocessing.resource_tracker, "_resource_tracker", None),
        "fork server": getattr(multiprocessing.forkserver, "_forkserver", None),
    }


def _helper_pid(helper: object) -> int | None:
    return getattr(helper, "_pid", None) or getattr(helper, "_forkserver_pid", None)


def _infrastructure_pids() -> set[int]:
    return {pid for pid in map(_helper_pid, _helpers().values()) if pid}


def _stop_helpers_started_since(running_before: set[int]) -> None:
    """Stop the helpers a test started, so that later tests see only their own children."""
    for helper in _helpers().values():
        pid = _helper_pid(helper)
        if pid and pid not in running_before:
            helper._stop()  # type: ignore[attr-defined]


def _leftover_children() -> list[psutil.Process]:
    infrastructure = _infrastructure_pids()
    children = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in infrastructure:
            continue
        try:
            if child.is_running():
                children.append(child)
        except psutil.NoSuchProcess:
            pass
    return children


def _describe(child: psutil.Process) -> str:
    try:
        return f"pid {child.pid} ({child.name()}, {child.status()})"
    except psutil.Error:
        return f"pid {child.pid}"


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except FileNotFoundError:  # no /dev/shm on this platform
        return set()


@pytest.fixture(autouse=True)
def no_leaked_processes_or_shared_memory() -> Iterator[None]:
    """Fail a test that leaves a child process or a new ``/dev/shm`` entry behind."""
    shm_before = _shm_entries()
    helpers_before = _infrastructure_pids()
    yield
    # Pools a test forgot in a reference cycle (tracebacks, pytest.raises) are leaks of the
    # test, not of envfleet, and would be freed anyway: collect them before looking.
    gc.collect()
    _stop_helpers_started_since(helpers_before)
    deadline = time.monotonic() + CHILD_EXIT_GRACE
    children = _leftover_children()
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = _leftover_children()
    problems = []
    if children:
        problems.append(
            "child processes still running after the test: "
            + ", ".join(_describe(c) for c in children)
        )
        for child in children:  # ours (children of this process): stop them for later tests
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=2.0)
    new_shm = sorted(_shm_entries() - shm_before)
    # multiprocessing names a semaphore in /dev/shm and unlinks it at once: one caught in that
    # instant (a lock being made by a thread still winding down) is gone a moment later.
    deadline = time.monotonic() + SHM_GRACE
    while new_shm and time.monotonic() < deadline:
        time.sleep(0.05)
        new_shm = sorted(_shm_entries() - shm_before)
    if new_shm:
        problems.append(f"new entries left in {SHM}: {new_shm}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    # What outlived the test (caches, a module's Ray) joins what collection built, out of the
    # next collections' sight: the ones after Ray's tests scanned it all after every test.
    gc.freeze()
