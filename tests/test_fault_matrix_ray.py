"""The failure matrix of ``test_fault_matrix.py`` on the ray backend, on one local Ray.

Ray takes seconds to start and each pool seconds to place its actors, so this module joins one
Ray for all its cells and runs a sample of the table (``test_ray.py`` covers more of the step
phase: env exceptions, dead and hung actors): each env fault in the step phase, then a cell or
two of every other phase and of ``"restart"``, every fault of the table somewhere (an actor
killed by SIGKILL and one stopped by SIGSTOP in the step phase). The cells run the checks of
the other backends (:func:`check_cell`); Ray's daemons are children of this process, so the
leak check is :func:`ray_leak_check`, which still fails a cell that leaves an actor behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")

import envfleet  # noqa: E402
from tests import matrix_hooks as hooks  # noqa: E402
from tests.envs import FaultyEnv  # noqa: E402
from tests.ray_helpers import local_ray_session, no_ray_leaks  # noqa: E402
from tests.test_fault_matrix import (  # noqa: E402
    check_cell,
    check_large_command_to_a_hung_worker,
    check_memory_limit_under_async,
    check_memory_recycling,
    check_undecodable_commands,
    not_applicable,
)

__all__ = ["local_ray_session", "no_ray_leaks"]  # fixtures, used by name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = (
    [("step", fault, "raise") for fault in hooks.ENV_FAULTS]
    + [("step", "broken_str", "restart"), ("make", "base_exception", "raise")]
    + [
        ("reset", "exit", "restart"),
        ("call", "unpicklable", "raise"),
        ("call", "segfault", "raise"),
    ]
    + [("close", "hang", "raise"), ("rebuild", "raise", "restart"), ("rebuild", "hang", "restart")]
    + [("step", "sigkill", "restart"), ("step", "sigstop", "raise")]
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("phase", "fault", "policy"), CELLS, ids=[f"{f}-{ph}-{po}" for ph, f, po in CELLS]
)
def test_ray_cell(ray_session: None, phase: str, fault: str, policy: str, tmp_path: Any) -> None:
    assert not_applicable("ray", fault, phase, policy) is None
    check_cell("ray", fault, phase, policy, str(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_a_large_command_to_a_hung_actor_waits_no_longer_than_step_timeout(
    ray_session: None, on_error: str
) -> None:
    """1 MiB for an actor hung in a step, over its socket: the send used to block the pool."""
    check_large_command_to_a_hung_worker("ray", on_error)


@pytest.mark.timeout(90)
def test_an_actor_over_its_memory_limit_is_recycled(
    ray_session: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory row of the matrix on Ray: an actor on the pool's machine is measured and
    replaced as a worker process is."""
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    check_memory_recycling("ray")


@pytest.mark.timeout(120)
def test_an_actor_never_idle_under_async_is_recycled_all_the_same(
    ray_session: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envfleet.recovery, "MEMORY_CHECK_INTERVAL", 0.0)
    check_memory_limit_under_async("ray")


@pytest.mark.timeout(60)
def test_a_command_an_actor_cannot_unpickle_fails_alone(ray_session: None) -> None:
    """Over the socket, as over a process's pipe (a Ray call's failure was named already)."""
    check_undecodable_commands("ray")


CHILD_EXIT_BOUND = 20.0
"""Seconds a forked child may take to exit (it takes well under one; it used to hang for ever,
in Ray's exit handler, or wait 5 s and crash in Ray's C++ one)."""

ZOMBIE_HOLD = 3.0
"""Seconds the ended child stays a zombie before its parent reaps it: several rounds of the
reaper (one each 0.5 s), which took a zombie child of the pool's process for the end of that
process and killed its Ray (the pool's next step then failed, and Ray ended the process 60 s
later: its GCS was gone). A child reaped within 50 ms left the reaper a narrow window."""


@pytest.mark.slow  # a Ray of its own in a child process: about 10 s to start here
@pytest.mark.timeout(120)
def test_a_private_ray_survives_a_forked_child_and_nothing_of_it_outlives_the_pool() -> None:
    """One process with a ray pool on a Ray of its own (one Ray started for both checks):

    - ``sys.exit(3)`` in a child forked from it: the child ends with status 3 at once, without
      a crash, and the parent's pool goes on stepping, also after the child was left a zombie
      for a while (:data:`ZOMBIE_HOLD`);
    - then SIGKILL of the pool's process: the Ray it started (daemons, agents, actors) goes
      too, and so does the directory of the actors' sockets in the temp dir (it used to stay,
      empty). Without envfleet's reaper, Ray's agents (``ray::DashboardAgent``,
      ``ray::RuntimeEnvAgent``) were still running 10 s later here (30 s when first seen)."""
    temp_dir = tempfile.mkdtemp(prefix="envfleet-ray-")  # short: Ray's socket paths go in it
    try:
        _kill_a_pool_with_its_own_ray(temp_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_a_pool_with_its_own_ray(temp_dir: str) -> None:
    code = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {REPO!r})
        import envfleet
        if __name__ == "__main__":
            pool = envfleet.make(
                "CartPole-v1", 2, backend="ray", ray_init_kwargs={{"_temp_dir": {temp_dir!r}}}
            )
            pool.reset(seed=0)
            pid = os.fork()
            if pid == 0:
                sys.exit(3)
            deadline = time.monotonic() + {CHILD_EXIT_BOUND!r}
            while time.monotonic() < deadline:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    time.sleep({ZOMBIE_HOLD!r})  # ended, not reaped yet: a zombie
                    status = os.waitpid(pid, 0)[1]
                    print("child", os.waitstatus_to_exitcode(status), flush=True)
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                print("child hung", flush=True)
            pool.step([0, 1])
            print("ready", flush=True)
            time.sleep(3600)
        """
    )
    pool_temp = os.path.join(temp_dir, "t")  # the pool's temp dir (TMPDIR), Ray's aside
    os.mkdir(pool_temp)
    errors = os.path.join(temp_dir, "stderr")  # a file: a pipe nobody reads could fill
    with open(errors, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "TMPDIR": pool_temp},
        )
    assert proc.stdout is not None
    lines = [proc.stdout.readline().strip(), proc.stdout.readline().strip()]
    if lines != ["child 3", "ready"]:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"{lines}: {Path(errors).read_text()[-3000:]}")
    assert [name for name in os.listdir(pool_temp) if name.startswith("envfleet-")]
    started = [
        child
        for child in psutil.Process(proc.pid).children(recursive=True)
        if child.name() in ("gcs_server", "raylet") or child.name().startswith("ray::")
    ]
    names = {child.name() for child in started}
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::GroupActor") for n in names)
    proc.kill()
    proc.wait(10)
    _gone, alive = psutil.wait_procs(started, timeout=5)
    assert not alive, f"Ray processes outlived the pool's process: {alive}"
    stderr = Path(errors).read_text()
    assert "SIGSEGV" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]
    # The reaper removes the socket directory once the Ray processes are gone.
    deadline = time.monotonic() + 5
    while os.listdir(pool_temp) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(pool_temp) == [], "the pool's socket directory outlived it"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", ["socket", "calls"])
def test_what_cannot_travel_leaves_a_ray_pool_as_it_was(ray_session: None, path: str) -> None:
    """Commands are pickled before the pool changes, on both ways to an actor."""
    lock = threading.Lock()
    actions = np.ones(hooks.NUM_ENVS, dtype=np.int64)
    with envfleet.make(
        FaultyEnv,
        hooks.NUM_ENVS,
        backend="ray",
        num_workers=hooks.NUM_WORKERS,
        seed=hooks.SEED,
        ray_shared_memory=path == "socket",
    ) as pool:
        pool.reset()
        with pytest.raises(TypeError, match="pickle"):
            pool.reset(seed=0, options={"lock": lock})
        with pytest.raises(TypeError, match="pickle"):
            pool.set_attr("episode_length", lock)
        assert pool.get_attr("episode_length") == (5,) * hooks.NUM_ENVS
        obs = pool.step(actions)[0]
    assert obs[:, 0].tolist() == [(hooks.SEED + i) * 100 + 1 for i in range(hooks.NUM_ENVS)]
