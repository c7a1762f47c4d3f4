"""The ray backend: the same pool semantics as the others, on one local Ray shared by the module.

Ray takes seconds to start here, so the module starts it once (:func:`ray_session`) and every
pool joins it; only the first test, which checks that a pool with no Ray running starts one and
shuts it down, runs before it. Ray's daemons are children of this process, so the module
overrides ``conftest.py``'s leak check with :func:`tests.ray_helpers.ray_leak_check` (which
still fails a test that leaves an actor or a Ray of its own behind).
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
import ray
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envfleet
import envfleet.backends.ray.call_path
import envfleet.backends.ray.transport
from tests import faults, gates, timing
from tests import test_gymnasium_dropin as dropin
from tests.envs import DictTupleEnv, FaultyEnv
from tests.ray_helpers import (
    LOOPBACK,
    envfleet_actor_pids,
    listening_addresses,
    local_ray_session,
    no_ray_leaks,
)
from tests.test_equivalence import (
    CASES,
    PICKLED_CASE,
    SEED,
    Case,
    assert_same,
    assert_same_run,
    drive,
    reference_run,
)
from tests.test_info_columns import INFO_SHIFT, assert_async_infos
from tests.test_pool_rollout import (
    POLICY_SEED,
    assert_rollout,
    assert_step_then_rollout,
    reference,
)

__all__ = ["local_ray_session", "no_ray_leaks"]  # fixtures, used by name

NUM_ENVS = 7
NUM_WORKERS = 3  # 7 envs as 3 + 2 + 2
FAST = 20.0
"""Seconds within which a failure must surface (no hang)."""
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "seed_simulator.py"


def make_ray(env: Any, path: str = "socket", **kwargs: Any) -> envfleet.Pool:
    """A ray pool whose actors (all on this machine) take commands over ``path``: ``"socket"``,
    the batch in shared memory (the default), or ``"calls"``: a Ray call each, as actors on
    other nodes do."""
    kwargs.setdefault("num_workers", NUM_WORKERS)
    pool = envfleet.make(env, NUM_ENVS, backend="ray", ray_shared_memory=path == "socket", **kwargs)
    assert same_machine(pool) == [path == "socket"] * NUM_WORKERS
    return pool


def same_machine(pool: envfleet.Pool) -> list[bool]:
    transport: envfleet.backends.ray.transport.RayTransport = pool._transport  # type: ignore[assignment]
    return transport.same_machine()


PATHS = ["socket", "calls"]
"""How actors take commands: both paths run the same tests."""


def wait_for_actors_to_exit(timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while envfleet_actor_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    return envfleet_actor_pids()


# -- connecting: a Ray of its own, or the caller's -------------------------------------------


@pytest.fixture
def stray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    """A Ray cluster started on this machine by someone else (``ray start --head``), named by
    ``RAY_ADDRESS`` as a shell that ran it would have it: its address and the pid of the
    ``ray start`` that runs it. Stopped (its processes only) after."""
    temp_dir = tempfile.mkdtemp(prefix="envfleet-stray-")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},  # on loopback only
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert head.poll() is None, "ray start --head exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the stray cluster did not start in 60 s"
                time.sleep(0.2)
        address = f"127.0.0.1:{port}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        yield address, head.pid
    finally:
        tree = [head, *psutil.Process(head.pid).children(recursive=True)]
        for process in tree:  # this cluster's processes only, never another Ray's
            try:
                process.terminate()
            except psutil.Error:
                pass
        # Its daemons outlast a SIGTERM by more than 10 s (nothing of it had ended then): a short
        # grace, then SIGKILL; its files go with its temp dir.
        _, alive = psutil.wait_procs(tree, timeout=1)
        for process in alive:
            process.kill()
        head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_pool_with_no_ray_running_starts_a_private_one_and_shuts_it_down(
    stray_cluster: tuple[str, int],
) -> None:
    """First in the module, before :func:`ray_session` starts the shared Ray. A cluster already
    runs on the machine (``RAY_ADDRESS`` names it): with no ``address`` the pool must not join
    it (its actors would run under another job's Python), but start a Ray of its own."""
    assert not ray.is_initialized(), "this test must run before the module's shared Ray starts"
    stray_address, stray_pid = stray_cluster

    def ours() -> set[int]:  # this process's children, the stray cluster's aside
        stray = {stray_pid, *(p.pid for p in psutil.Process(stray_pid).children(recursive=True))}
        return {p.pid for p in psutil.Process().children(recursive=True)} - stray

    temp_dir = tempfile.mkdtemp(prefix="envfleet-ray-")
    try:
        before = ours()
        with make_ray("CartPole-v1", ray_init_kwargs={"_temp_dir": temp_dir}, seed=0) as pool:
            assert ray.is_initialized()
            joined = ray.get_runtime_context().gcs_address
            assert joined.rpartition(":")[2] != stray_address.rpartition(":")[2], (
                f"the pool joined the stray cluster at {stray_address} ({joined})"
            )
            started = [psutil.Process(pid) for pid in ours() - before]
            names = {p.name() for p in started}
            assert {"gcs_server", "raylet"} <= names, f"no Ray of its own among {names}"
            # A Ray of its own serves this process alone: on loopback, nothing listens elsewhere.
            assert joined.startswith("127.0.0.1:"), joined
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            listening = listening_addresses(started)
            assert listening and listening <= set(LOOPBACK), listening
            assert len(envfleet_actor_pids()) == NUM_WORKERS
            pool.reset()
            pool.step(np.zeros(NUM_ENVS, dtype=np.int64))
        assert not ray.is_initialized(), "close() left the Ray it started running"
        _, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, f"Ray processes still running after close(): {alive}"
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("init_kwargs", [{}, {"address": None}], ids=["none", "address None"])
def test_no_address_asks_ray_for_a_local_one(
    monkeypatch: pytest.MonkeyPatch, init_kwargs: dict[str, Any]
) -> None:
    """What ``ray.init`` is asked when no address is given (``ray_init_kwargs`` with
    ``address=None`` too): ``"local"``, which Ray never reads as ``RAY_ADDRESS`` or its record of
    the last cluster started on the machine, as it does a bare ``ray.init()``."""
    from envfleet.backends.ray import session as connection

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(connection.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(connection.ray, "init", lambda **kw: asked.append(kw))
    monkeypatch.setattr(connection, "_session_id", lambda: "fake")
    monkeypatch.setattr(connection.reaper, "start", lambda: None)
    monkeypatch.setattr(connection, "_session", None)
    monkeypatch.setattr(connection, "_users", 0)
    assert connection.connect(None, dict(init_kwargs)) is True
    assert [kw["address"] for kw in asked] == ["local"]


def test_pool_leaves_a_ray_it_joined_running(ray_session: None) -> None:
    """One pool on the module's Ray (a pool's start takes seconds, so these checks share it):

    - a new pool removes the socket directories of pools whose process is gone (killed without
      close() on a Ray envfleet did not start: no reaper), and leaves a live process's;
    - its actors' sockets live in the pool's own directory (0700), its batch memory is open;
    - close() returns once the actors' processes here have ended (``ray.kill`` only asks Ray,
      whose daemons can take seconds on a busy machine), frees the sockets and removes their
      directory, and leaves the Ray it joined running;
    - the batch memory goes with the pool (the observations it returned may still be in use).
    """
    from envfleet.backends.ray.reaper import SOCKET_DIR_PREFIX

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    temp = tempfile.gettempdir()
    stale = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{dead.pid}-", dir=temp)
    Path(stale, "w-0").touch()  # as an actor's socket left behind
    live = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getppid()}-", dir=temp)
    memory_before = batch_memory_files()
    try:
        with make_ray("CartPole-v1", seed=0) as pool:
            socket_dir = pool._transport._socket_dir  # type: ignore[attr-defined]
            assert os.path.basename(socket_dir).startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
            assert not os.path.exists(stale), "a dead process's socket directory was left"
            assert os.path.isdir(live), "a live process's socket directory was removed"
            assert len(batch_memory_files()) > len(memory_before), "no batch memory open"
            sockets = [slot.conn for slot in pool._transport._workers]  # type: ignore[attr-defined]
            assert all(conn is not None and not conn.closed for conn in sockets)
            # The actors' sockets live in the pool's own directory (0700), which close() removes
            # even if an actor died before the pool connected to it.
            assert os.stat(socket_dir).st_mode & 0o777 == 0o700
            for conn in sockets:
                assert conn is not None
                with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                    assert peer.getpeername().startswith(socket_dir + os.sep)
            assert len(envfleet_actor_pids()) == NUM_WORKERS
            pool.reset()
            pool.step(np.ones(NUM_ENVS, dtype=np.int64))
        assert envfleet_actor_pids() == [], "actors still running as close() returned"
        assert ray.is_initialized(), "close() shut down the caller's Ray"
        assert ray.get(ray.put(42)) == 42
        assert all(conn.closed for conn in sockets), "close() left a socket open"
        assert not os.path.exists(socket_dir), "close() left the socket directory"
        # The observations it returned may still be in use: the memory lives while the pool does.
        del pool
        gc.collect()
        assert batch_memory_files() == memory_before, "the batch memory outlived the pool"
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_close_returns_once_the_actors_processes_here_have_ended(ray_session: None) -> None:
    """As :func:`test_pool_leaves_a_ray_it_joined_running` checks on the socket path, on the
    path of Ray calls: close() waits for the actors' processes on this machine (and ends those
    still there), so nothing of the pool runs here once it returns."""
    pool = make_ray("CartPole-v1", "calls", seed=0)
    pool.reset()
    assert len(envfleet_actor_pids()) == NUM_WORKERS
    pool.close()
    assert envfleet_actor_pids() == [], "actors still running as close() returned"


def test_cli_address_auto_says_which_cluster_it_joined(ray_session: None) -> None:
    """``envfleet run --address auto`` names the cluster it found before it runs: its address,
    nodes and CPUs. The cluster is this module's private Ray, named by ``RAY_ADDRESS`` (as Ray's
    "auto" reads it first): never one that happens to run on the machine."""
    address = ray.get_runtime_context().gcs_address
    root = Path(__file__).resolve().parent.parent
    argv = ["run", "CartPole-v1", "--backend", "ray", "--address", "auto", "--num-envs", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "envfleet.cli", *argv, "--steps", "50"],
        capture_output=True,
        text=True,
        cwd=root,
        env={
            **os.environ,
            "PYTHONPATH": str(root),
            "RAY_ADDRESS": address,
            # The module's Ray is on loopback: a driver joins it from loopback only.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        },
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    joined = [line for line in result.stderr.splitlines() if "joined" in line]
    assert joined == [f"envfleet: joined the Ray cluster at {address}: 1 node, 2 CPUs"], (
        result.stderr
    )
    lines = result.stderr.splitlines()
    assert lines.index(joined[0]) < next(i for i, x in enumerate(lines) if "running" in x)
    assert ray.is_initialized()  # the run left this module's Ray running


def batch_memory_files() -> list[str]:
    """This process's open descriptors on a pool's batch memory (``memfd:envfleet-batch``)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
    return [link for link in links if "envfleet-batch" in link]


def _hang_in_close(env: FaultyEnv) -> None:
    if env.seed_used is not None:  # not the env make() builds in the caller
        time.sleep(3600)


def test_ctrl_c_while_actors_close_still_kills_them(
    ray_session: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while close() waits for actors whose envs' ``close`` hangs: the actors are
    killed before it goes on (the pool is closed; a second close() does nothing)."""
    pool = make_ray(FaultyEnv, env_kwargs={"close_hook": _hang_in_close})
    pool.reset(seed=0)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(envfleet.backends.ray.transport.ray, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close(timeout=30.0)
    monkeypatch.undo()
    assert wait_for_actors_to_exit() == []
    pool.close()


# -- same results as SyncVectorEnv and the serial backend --------------------------------------

RAY_CASES = {**CASES, "Pickled": PICKLED_CASE}
"""``Pickled``: observations that do not fit arrays (Text in a Dict) travel as per-env values."""

SYNC_RUNS = [
    *((case, mode) for case in ("CartPole", "DictTuple") for mode in AutoresetMode),
    ("Pong", AutoresetMode.SAME_STEP),
    ("Pickled", AutoresetMode.SAME_STEP),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("case_name", "mode"), SYNC_RUNS, ids=[f"{c}-{m.name}" for c, m in SYNC_RUNS]
)
def test_sync_steps_are_bit_identical_to_sync_vector_env(
    ray_session: None, case_name: str, mode: AutoresetMode, path: str
) -> None:
    """Every case and mode over both paths, against SyncVectorEnv's run of it (that of
    ``test_equivalence.py``, computed once per run: Pong is slow to build); the DictTuple and
    SAME_STEP pools then run :func:`check_rollout_matches_sync_vector_env` (a pool's start takes
    seconds)."""
    case = RAY_CASES[case_name]
    expected = reference_run("TextDict" if case_name == "Pickled" else case_name, mode)
    with make_ray(case.env, path, env_kwargs=case.kwargs, autoreset_mode=mode) as pool:
        assert pool.single_observation_space == expected.observation_space
        label = f"{case_name}/{mode.name} SyncVectorEnv vs ray ({path})"
        assert_same_run(expected.records, pool, case, mode, label)
        if (case_name, mode) == ROLLOUT_RUN:
            check_rollout_matches_sync_vector_env(pool, mode)


def row(batch: Any, j: int) -> Any:
    """Row ``j`` of a batch of observations (numpy arrays, or Dict/Tuple nests of them)."""
    if isinstance(batch, dict):
        return {key: row(value, j) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(row(value, j) for value in batch)
    return batch[j].copy()


def row_info(infos: dict[str, Any], j: int) -> dict[str, Any]:
    """The info of row ``j`` of a batch of infos (what its ``_key`` masks say it has)."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_") or key == "env_id" or not infos[f"_{key}"][j]:
            continue
        out[key] = row_info(value, j) if isinstance(value, dict) else value[j]
    return out


Record = tuple[Any, ...]


def drive_async(pool: envfleet.Pool, case: Case, mode: AutoresetMode) -> list[list[Record]]:
    """Per env, what ``recv`` returned for it, each env stepped with its own seeded actions.

    Which envs each ``recv`` returns depends on timing, so results are gathered per env: an
    env's sequence depends only on its seed and actions, whatever the order. Each env draws its
    actions from its own seeded copy of the action space, so an env that runs ahead (an actor
    scheduled more often on a loaded machine) keeps stepping, up to ``RUN_AHEAD`` times the
    case's steps, until every env has taken the case's steps.
    """
    spaces = [copy.deepcopy(pool.single_action_space) for _ in range(NUM_ENVS)]
    for i, space in enumerate(spaces):
        space.seed(SEED + i)
    records: list[list[Record]] = [[] for _ in range(NUM_ENVS)]
    taken = [0] * NUM_ENVS
    pool.async_reset(seed=SEED)
    while True:
        obs, rewards, terminations, truncations, infos = pool.recv()
        ids = infos["env_id"].tolist()
        ended = []
        for j, i in enumerate(ids):
            record = (row(obs, j), rewards[j], terminations[j], truncations[j], row_info(infos, j))
            records[i].append(record)
            if mode is AutoresetMode.DISABLED and (terminations[j] or truncations[j]):
                ended.append(i)
        if ended:
            pool.async_reset(env_id=ended)
        if min(taken) < case.steps:
            to_step = [i for i in ids if i not in ended and taken[i] < RUN_AHEAD * case.steps]
            if to_step:
                pool.send(np.stack([spaces[i].sample() for i in to_step]), to_step)
                for i in to_step:
                    taken[i] += 1
        if pool._ledger.owed() < pool.batch_size:  # too few left for a recv
            return records


@functools.cache
def serial_async_run(case_name: str, mode: AutoresetMode) -> list[list[Record]]:
    """What :func:`drive_async` gets from the serial backend, per env (each env's sequence
    depends on its seed and actions only), computed once per case and mode for both paths."""
    case = CASES[case_name]
    with envfleet.make(
        case.env,
        NUM_ENVS,
        backend="serial",
        env_kwargs=case.kwargs,
        autoreset_mode=mode,
        batch_size=3,
    ) as serial:
        return drive_async(serial, case, mode)


RUN_AHEAD = 8
"""How far (times a case's steps) an env may run ahead of the slowest in :func:`drive_async`."""


ASYNC_RUNS = [
    ("CartPole", AutoresetMode.DISABLED),
    ("DictTuple", AutoresetMode.SAME_STEP),
    ("Pong", AutoresetMode.NEXT_STEP),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("case_name", "mode"), ASYNC_RUNS, ids=[f"{c}-{m.name}" for c, m in ASYNC_RUNS]
)
def test_async_results_are_bit_identical_to_serial(
    ray_session: None, case_name: str, mode: AutoresetMode, path: str
) -> None:
    case = CASES[case_name]
    common = {"env_kwargs": case.kwargs, "autoreset_mode": mode, "batch_size": 3}
    expected = serial_async_run(case_name, mode)
    with make_ray(case.env, path, **common) as pool:
        got = drive_async(pool, case, mode)
    for i in range(NUM_ENVS):
        # Every env normally takes the case's steps; fewer than half means one was starved (an env
        # 16 times slower than the rest), which is worth failing on.
        n = min(len(expected[i]), len(got[i]))
        assert n > case.steps // 2, f"env {i}: only {n} results"
        for k in range(n):
            assert_same(expected[i][k], got[i][k], f"{case_name} env {i} result {k}")


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=[m.name for m in AutoresetMode])
def test_infos_over_the_sockets_are_bit_identical_to_serial(
    ray_session: None, mode: AutoresetMode
) -> None:
    """Infos of plain scalars (as columns over the sockets) that change keys, order and types
    from step to step, mixed with dict infos: every result as serial's."""
    with (
        envfleet.make(INFO_SHIFT.env, NUM_ENVS, backend="serial", autoreset_mode=mode) as serial,
        make_ray(INFO_SHIFT.env, autoreset_mode=mode) as pool,
    ):
        label = f"InfoShift/{mode.name} serial vs ray (socket)"
        assert_same_run(drive(serial, INFO_SHIFT, mode), pool, INFO_SHIFT, mode, label)


def test_async_batches_get_each_envs_own_infos_over_the_sockets(ray_session: None) -> None:
    """Infos as columns from actors on the pool's machine: each async batch has exactly its
    envs' infos, as ``_add_info`` merges them."""
    assert_async_infos(backend="ray", num_workers=NUM_WORKERS)


@pytest.mark.parametrize("path", PATHS)
def test_call_get_attr_set_attr_and_seed_match_serial(ray_session: None, path: str) -> None:
    with (
        envfleet.make(DictTupleEnv, NUM_ENVS, backend="serial", seed=SEED) as serial,
        make_ray(DictTupleEnv, path, seed=SEED) as pool,
    ):
        # seed=SEED at make: the first reset (without a seed) seeds env i with SEED + i.
        assert_same(serial.reset(), pool.reset(), "reset")
        actions = pool.action_space.sample()
        assert_same(serial.step(actions), pool.step(actions), "step")
        assert_same(serial.render(), pool.render(), "render")
        assert pool.get_attr("max_steps") == (12,) * NUM_ENVS
        pool.set_attr("max_steps", list(range(20, 20 + NUM_ENVS)))
        assert pool.get_attr("max_steps") == tuple(range(20, 20 + NUM_ENVS))
        pool.set_attr("max_steps", 30)
        assert pool.get_attr("max_steps") == (30,) * NUM_ENVS
        assert pool.call("get_wrapper_attr", "max_steps") == (30,) * NUM_ENVS


# -- failures: the same error path as the process backend ------------------------------------

VICTIM_WORKER = 1  # env 3 of 7 over 3 workers: worker 1 holds envs 3 and 4
VICTIM_ENVS = (3, 4)
ACTIONS = np.ones(NUM_ENVS, dtype=np.int64)


def step_to_failure(pool: envfleet.Pool) -> Any:
    """Reset with the faults' seed and step up to the failing step; return its result."""
    pool.reset(seed=faults.SEED)
    for _ in range(faults.FAIL_AT_STEP - 1):
        pool.step(ACTIONS)
    start = time.monotonic()
    try:
        return pool.step(ACTIONS)
    finally:
        assert time.monotonic() - start < FAST, "the failure took too long to surface"


def assert_restarted(pool: envfleet.Pool, result: Any, envs: tuple[int, ...]) -> None:
    """``envs`` report a truncated episode flagged restarted; the pool goes on."""
    _, rewards, terminations, truncations, infos = result
    mask = np.isin(np.arange(NUM_ENVS), envs)
    assert (truncations == mask).all() and not terminations[mask].any()
    assert (infos["_envfleet/restarted"] == mask).all()
    assert (rewards[mask] == 0).all()
    assert (pool.restarts == mask).all()
    for _ in range(3):
        _, _, _, truncations, infos = pool.step(ACTIONS)
        assert "envfleet/restarted" not in infos
    assert (pool.restarts == mask).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_env_exception(ray_session: None, on_error: str, path: str) -> None:
    hook = faults.raise_value_error_in_step
    with make_ray(FaultyEnv, path, env_kwargs={"step_hook": hook}, on_error=on_error) as pool:
        if on_error == "restart":
            assert_restarted(pool, step_to_failure(pool), (faults.VICTIM,))
            return
        with pytest.raises(envfleet.EnvRaisedError) as info:
            step_to_failure(pool)
        error = info.value
        assert (error.env_index, error.worker, error.phase) == (
            faults.VICTIM,
            VICTIM_WORKER,
            envfleet.Phase.STEP,
        )
        assert isinstance(error.__cause__, ValueError)
        assert "boom in step" in str(error)
        with pytest.raises(envfleet.BrokenPoolError):
            pool.step(ACTIONS)


def _keyboard_interrupt_in_step(env: FaultyEnv, action: Any) -> None:
    if env.seed_used == 1 and env.count == 101:  # env 1's second step, once
        raise KeyboardInterrupt


@pytest.mark.parametrize("path", PATHS)
def test_keyboard_interrupt_raised_by_an_env_is_that_envs_failure(
    ray_session: None, path: str
) -> None:
    """As on the thread and process backends (``test_errors.py``): the env's own
    ``KeyboardInterrupt`` is its failure, named env 1, not a lost actor; restarted, it is one
    env's restart."""
    env = functools.partial(FaultyEnv, step_hook=_keyboard_interrupt_in_step)
    actions = np.zeros(2, dtype=np.int64)
    kwargs: dict[str, Any] = {"backend": "ray", "seed": 0, "ray_shared_memory": path == "socket"}
    with envfleet.make(env, 2, num_workers=2, **kwargs) as pool:
        pool.reset()
        pool.step(actions)
        with pytest.raises(envfleet.EnvRaisedError) as info:
            pool.step(actions)
    assert (info.value.env_index, info.value.worker) == (1, 1)
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    with envfleet.make(env, 2, num_workers=2, on_error="restart", **kwargs) as pool:
        pool.reset()
        results = [pool.step(actions) for _ in range(3)]
        assert results[1][4]["envfleet/restarted"].tolist() == [False, True]
        assert pool.restarts.tolist() == [0, 1]


DEAD_ACTOR_RUNS = [
    *((on_error, path) for on_error in ("raise", "restart") for path in PATHS),
    ("restart-pieces", "calls"),
]


@pytest.mark.parametrize(("on_error", "path"), DEAD_ACTOR_RUNS)
def test_dead_actor(
    ray_session: None, on_error: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The victim's actor process exits mid-step (os._exit), as if killed.

    ``restart-pieces``: every result travels in pieces (as large observations do), see
    :meth:`envfleet.backends.ray.actor.GroupActor.run_chunked`.
    """
    if on_error == "restart-pieces":
        monkeypatch.setattr(envfleet.backends.ray.call_path, "CHUNK_BYTES", 16)
        on_error = "restart"
    hook = faults.exit_in_step
    with make_ray(FaultyEnv, path, env_kwargs={"step_hook": hook}, on_error=on_error) as pool:
        if on_error == "restart":
            assert_restarted(pool, step_to_failure(pool), VICTIM_ENVS)
            assert len(envfleet_actor_pids()) == NUM_WORKERS
            # The replacement actor is on this machine too: it takes the same path.
            assert same_machine(pool) == [path == "socket"] * NUM_WORKERS
            return
        with pytest.raises(envfleet.WorkerDiedError) as info:
            step_to_failure(pool)
        error = info.value
        assert (error.worker, error.env_ids, error.phase) == (
            VICTIM_WORKER,
            VICTIM_ENVS,
            envfleet.Phase.STEP,
        )
        # The others' results of that step are gathered onto the error.
        assert error.completed is not None
        assert sorted(error.completed[4]["env_id"].tolist()) == [0, 1, 2, 5, 6]


@pytest.mark.parametrize("path", PATHS)
def test_hung_actor_is_killed_after_step_timeout(
    ray_session: None, tmp_path: Path, path: str
) -> None:
    never = str(tmp_path / "never-created")
    hook = functools.partial(gates.wait_for_file, path=never, env_seed=faults.SEED + faults.VICTIM)
    with make_ray(FaultyEnv, path, env_kwargs={"step_hook": hook}, step_timeout=2.0) as pool:
        pool.reset(seed=faults.SEED)
        start = time.monotonic()
        with pytest.raises(envfleet.EnvTimeoutError) as info:
            pool.step(ACTIONS)
        assert 2.0 <= time.monotonic() - start < FAST
        assert (info.value.worker, info.value.env_ids) == (VICTIM_WORKER, VICTIM_ENVS)


def stop_in_step(env: FaultyEnv, action: Any, *, env_seed: int) -> None:
    """The env seeded ``env_seed`` stops its process (SIGSTOP) in its step."""
    if env.seed_used == env_seed:
        os.kill(os.getpid(), signal.SIGSTOP)


def test_a_stopped_actor_on_the_pools_machine_is_reported_hung_past_step_timeout_at_once(
    ray_session: None,
) -> None:
    """An actor stopped by SIGSTOP cannot exit when Ray asks it to: Ray kills it 5 s later.
    On the pool's machine the pool kills its process itself, so the error comes right after
    step_timeout, not 5 s later."""
    hook = functools.partial(stop_in_step, env_seed=faults.SEED + faults.VICTIM)
    with make_ray(FaultyEnv, "socket", env_kwargs={"step_hook": hook}, step_timeout=1.0) as pool:
        pool.reset(seed=faults.SEED)
        start = time.monotonic()
        with pytest.raises(envfleet.EnvTimeoutError) as info:
            pool.step(ACTIONS)
        took = time.monotonic() - start
        assert 1.0 <= took < 1.0 + timing.bound(2.5, pools=1), f"reported after {took:.2f} s"
        assert (info.value.worker, info.value.env_ids) == (VICTIM_WORKER, VICTIM_ENVS)


# -- the founding question ---------------------------------------------------------------------


def test_seed_simulator_example(
    ray_session: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One actor (serial) > two actors > envfleet, with 0.2 s steps instead of 1 s."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--step-seconds", "0.2"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    timings = {int(m[1]): float(m[2]) for m in re.finditer(r"^\((\d)\).*?([\d.]+) s$", out, re.M)}
    assert sorted(timings) == [1, 2, 3], out
    one_actor, two_actors, fleet = timings[1], timings[2], timings[3]
    assert fleet < two_actors < one_actor, out
    assert one_actor >= 4 * 0.2 and two_actors >= 2 * 0.2 and fleet >= 0.2, out
    assert ray.is_initialized(), "the example shut down a Ray it did not start"


@pytest.mark.parametrize("path", PATHS)
def test_actors_run_on_the_cpus_given(ray_session: None, path: str) -> None:
    from tests.test_affinity import AffinityEnv, last_cpu

    cpu = last_cpu()
    with make_ray(AffinityEnv, path, cpu_affinity=[cpu]) as pool:
        pool.reset(seed=0)
        pool.step(np.zeros(NUM_ENVS, dtype=np.int64))
        assert pool.call("cpus") == ([cpu],) * NUM_ENVS


# -- env_fns and registered ids in actors ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_env_fns_match_sync_vector_env_and_registered_ids_build(
    ray_session: None, path: str
) -> None:
    """Heterogeneous ``env_fns`` (float64 actions) give ``SyncVectorEnv``'s results in every
    autoreset mode, sync and async, and an id registered only in this process builds in the
    actors (their registry lacks it). The async batches run on the pool that ran sync (each
    env reset with the seed again): an actor's start is the slow part here."""
    env_fns = dropin.HETERO["Pendulum"]
    for mode in AutoresetMode:
        with envfleet.make(
            env_fns,
            backend="ray",
            num_workers=2,
            autoreset_mode=mode,
            ray_shared_memory=path == "socket",
        ) as pool:
            got = list(dropin.sync_drive(pool, env_fns, mode))
            expected = dropin.reference("Pendulum", mode)
            assert len(got) == len(expected)
            for (what, want), (_, result) in zip(expected, got, strict=True):
                assert_same(want, result, f"ray/{path}/{mode.name} {what}")
            if path == "socket":  # async batches: each env's own results are SyncVectorEnv's
                dropin.check_async_batches_per_env(pool, mode)
    env_id = "envfleet-test/RayRegistered-v0"
    gymnasium.register(env_id, entry_point="tests.envs:DictTupleEnv", kwargs={"max_steps": 4})
    try:
        with envfleet.make(
            env_id, 2, backend="ray", num_workers=2, ray_shared_memory=path == "socket"
        ) as pool:
            assert pool.get_attr("max_steps") == (4, 4)
            obs, _ = pool.reset(seed=5)
        reference = SyncVectorEnv([functools.partial(gymnasium.make, env_id)] * 2)
        assert_same(reference.reset(seed=5)[0], obs)
        reference.close()
    finally:
        gymnasium.registry.pop(env_id, None)


@pytest.mark.parametrize("pattern", ["naive", "batched"])
def test_plain_ray_baselines_of_the_benchmark_step_and_go(ray_session: None, pattern: str) -> None:
    from bench.throughput import open_batched_ray, open_naive_ray
    from envfleet.affinity import usable_cpus
    from envfleet.benchmark import Timing, Workload

    opener = {"naive": open_naive_ray, "batched": open_batched_ray}
    timing = Timing(seconds=0.05, warmup=0.02, rewarm=0.01, repeats=1)
    runner = opener[pattern](Workload.of("CartPole-v1", 3), timing)
    try:
        assert runner.info["actors"] == (3 if pattern == "naive" else min(len(usable_cpus()), 3))
        assert runner.window(0.05) > 0
    finally:
        runner.close()


def test_step_before_reset_is_refused(ray_session: None) -> None:
    from tests.test_api import NeedsResetEnv, check_step_before_reset_is_refused

    check_step_before_reset_is_refused(
        envfleet.make(NeedsResetEnv, 4, backend="ray", num_workers=2)
    )


def test_ids_registered_in_the_caller_build_inside_factories(ray_session: None) -> None:
    from tests.test_registration import check_caller_ids_inside_factories

    check_caller_ids_inside_factories(backend="ray", num_workers=2)


def test_make_sb3_env_fns_match_subproc_vec_env(ray_session: None) -> None:
    pytest.importorskip("stable_baselines3")
    from tests.test_sb3 import check_env_fns_match_subproc_vec_env

    check_env_fns_match_subproc_vec_env(backend="ray", num_workers=2)


ROLLOUT_RUN = ("DictTuple", AutoresetMode.SAME_STEP)
"""The cell of :func:`test_sync_steps_are_bit_identical_to_sync_vector_env` whose pools (one per
path) also run :func:`check_rollout_matches_sync_vector_env`."""


def check_rollout_matches_sync_vector_env(pool: envfleet.Pool, mode: AutoresetMode) -> None:
    """``pool.rollout`` through actors (their rows in the pool's memory, or shipped back as
    Ray calls): SyncVectorEnv's run with the same policy, then plain steps, then a rollout
    (``pool``: seven DictTupleEnvs, reset here)."""
    ref = SyncVectorEnv([DictTupleEnv] * NUM_ENVS, autoreset_mode=mode)
    want, last = reference(
        ref, envfleet.RandomPolicy(ref.single_action_space, POLICY_SEED), "p" * 6 + "f" + "p" * 5
    )
    ref.close()
    policy = envfleet.RandomPolicy(pool.single_action_space, POLICY_SEED)
    pool.reset(seed=faults.SEED)
    assert_rollout(pool.rollout(policy, 6), want[:6], "first rollout")
    assert_step_then_rollout(pool, policy, want, last, 6)


@pytest.mark.parametrize("path", PATHS)
def test_queued_parts_through_actors_are_the_rollouts_one_after_another(
    ray_session: None, path: str
) -> None:
    """A part queued behind each actor's (``queue=True``): each hand-over is the serial
    backend's rollout of that turn, over both paths."""
    from tests.test_rollout_async import Linear, weights

    with envfleet.make("CartPole-v1", NUM_ENVS, backend="serial", seed=0) as serial:
        serial.reset()
        want = [serial.rollout(Linear(weights(v)), 6) for v in (1, 2)]
    with make_ray("CartPole-v1", path, seed=0) as pool:
        pool.reset()
        pool.rollout_async(Linear(weights(1)), 6)
        pool.rollout_async(Linear(weights(2)), 6, queue=True)
        got = [pool.rollout_wait(), pool.rollout_wait()]
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        assert (g.policy_versions == k + 1).all()
        for field in ("observations", "actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(w, field), getattr(g, field), f"{k} {field}")
        np.testing.assert_array_equal(w.final_observations, g.final_observations)
