"""Leak checks for the Ray test modules, where Ray's own daemons are children of pytest.

``tests/conftest.py`` fails a test that leaves any child process behind. A Ray started by a test
module (``ray.init`` or ``ray.cluster_utils.Cluster``) runs its daemons (``gcs_server``,
``raylet``, agents, idle ``ray::IDLE`` workers) as children of this process for the whole module,
so the Ray modules override that fixture with :func:`ray_leak_check`: a child process that
appeared during the test and is still alive after it is a leak, except Ray's idle workers (the
raylet starts and stops those when it likes). That still catches what envfleet must clean up:
the actors of a closed pool (``ray::GroupActor`` processes) and the daemons of a Ray that a pool
started itself. New ``/dev/shm`` entries are leaks too, as in ``conftest.py``. A module whose
tests add nodes to its cluster on purpose passes ``ray_daemons_too=False``: then only actors
(and processes that are not Ray's) count.
"""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Iterator

import psutil
import pytest

from envfleet.backends.ray.ended import ended

GRACE = 10.0
"""Seconds a killed actor's process gets to exit (``ray.kill`` is asynchronous)."""

SHM = "/dev/shm"


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except FileNotFoundError:
        return set()


_RAYS_OWN = re.compile(r"sem\.[A-Za-z0-9]{6}\Z")
"""glibc's ``sem_open`` makes a semaphore as ``sem.XXXXXX`` (six random characters), then links
it to its name and unlinks that: a process killed in between leaves it. envfleet makes no named
semaphore in an actor or a worker (``multiprocessing``'s are ``sem.mp-*``); Ray's core worker,
in every actor's process, does (its ``MutableObjectManager``), so a SIGKILLed actor may leave
one of Ray's. Not ours to clean up, and not a leak of the pool."""


def _children() -> dict[int, psutil.Process]:
    return {child.pid: child for child in psutil.Process().children(recursive=True)}


def _is_idle_ray_worker(child: psutil.Process) -> bool:
    """An idle Ray worker, or one still starting (before it names itself ``ray::...``)."""
    try:
        name = child.name()
        if name == "ray::IDLE":
            return True
        if name.startswith("ray::"):
            return False
        return any("default_worker.py" in part for part in child.cmdline())
    except psutil.Error:
        return True  # already gone


RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _is_ray_daemon(child: psutil.Process) -> bool:
    """One of the processes a Ray node runs (not a worker that hosts an actor)."""
    try:
        name = child.name()
        if name in RAY_DAEMONS:
            return True
        if name.startswith("ray::"):
            return False
        return any(f"{os.sep}ray{os.sep}" in part for part in child.cmdline())
    except psutil.Error:
        return True  # already gone


def _new_alive(before: set[int], ray_daemons_too: bool) -> list[psutil.Process]:
    leftover = []
    for pid, child in _children().items():
        if pid in before or _is_idle_ray_worker(child):
            continue
        if not ray_daemons_too and _is_ray_daemon(child):
            continue
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                leftover.append(child)
        except psutil.NoSuchProcess:
            pass
    return leftover


def _describe(child: psutil.Process) -> str:
    try:
        return f"pid {child.pid} ({child.name()})"
    except psutil.Error:
        return f"pid {child.pid}"


def ray_leak_check(ray_daemons_too: bool = True) -> Iterator[None]:
    """Body of the Ray modules' ``no_leaked_processes_or_shared_memory`` fixture.

    Args:
        ray_daemons_too: whether the daemons of a Ray node started during the test count as
            leaks (``False`` where tests add nodes to a module's cluster on purpose).
    """
    before = set(_children())
    shm_before = _shm_entries()
    yield
    gc.collect()  # pools a test left in a reference cycle (tracebacks) close here
    deadline = time.monotonic() + GRACE
    leftover = _new_alive(before, ray_daemons_too)
    while leftover and time.monotonic() < deadline:
        time.sleep(0.1)
        leftover = _new_alive(before, ray_daemons_too)
    problems = []
    if leftover:
        problems.append(
            "processes started during the test still run after it: "
            + ", ".join(_describe(child) for child in leftover)
        )
        for child in leftover:
            try:
                child.kill()
            except psutil.Error:
                pass
    new_shm = sorted(name for name in _shm_entries() - shm_before if not _RAYS_OWN.match(name))
    if new_shm:
        problems.append(f"new entries left in {SHM}: {new_shm}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening_addresses(processes: list[psutil.Process]) -> set[str]:
    """The addresses ``processes`` listen on (TCP and UDP): loopback ones only for a Ray that
    serves this machine alone."""
    pids = {p.pid for p in processes}
    return {
        conn.laddr.ip
        for conn in psutil.net_connections(kind="inet")
        if conn.pid in pids and conn.laddr and (conn.status == psutil.CONN_LISTEN or not conn.raddr)
    }


def envfleet_actor_pids() -> list[int]:
    """Processes of this process tree now running an envfleet actor (one that has exited,
    not yet reaped by the raylet, runs nothing: not counted)."""
    pids = []
    for pid, child in _children().items():
        try:
            if child.name().startswith("ray::GroupActor") and not ended(child):
                pids.append(pid)
        except psutil.Error:
            pass
    return pids


def local_ray() -> Iterator[None]:
    """A module's one local Ray for its pools (``address="local"``: never another run's), on
    loopback as a pool's own Ray is (nothing of it reachable from another machine); for a
    module-scoped fixture: ``yield from local_ray()``."""
    import ray

    from envfleet.backends.ray.session import loopback

    assert not ray.is_initialized()
    with loopback():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(name="no_leaked_processes_or_shared_memory", autouse=True)
def no_ray_leaks() -> Iterator[None]:
    """conftest.py's leak check, for a module with a local Ray (import it into the module):
    Ray's daemons outlive tests, envfleet's actors must not."""
    yield from ray_leak_check()


@pytest.fixture(name="no_leaked_processes_or_shared_memory", autouse=True)
def no_node_leaks() -> Iterator[None]:
    """conftest.py's leak check, for a module with a cluster of its own (import it into the
    module): the nodes' daemons belong to the cluster (tests may add nodes); no agent, worker
    process of an agent or actor of a closed pool may outlive its test."""
    yield from ray_leak_check(ray_daemons_too=False)


@pytest.fixture(name="ray_session", scope="module")
def local_ray_session() -> Iterator[None]:
    """One local Ray for the module's pools (:func:`local_ray`; import it into the module)."""
    yield from local_ray()
