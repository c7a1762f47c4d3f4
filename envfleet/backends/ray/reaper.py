"""The reaper of a Ray envfleet started, and the pools' socket directories.

A Ray of envfleet's own gets a reaper (:data:`REAPER`), a process of its own that ends the
Ray's processes should the pool's process be killed; the pools' socket directories (actors on
this machine) are named after their process, so that the reaper, or a later pool, removes
those left behind (:func:`make_socket_dir`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

_reaper: subprocess.Popen[bytes] | None = None  # ends the Ray envfleet started if we are killed

SOCKET_DIR_PREFIX = "envfleet-ray-"
"""A pool's socket directory in the temp dir is ``envfleet-ray-<pid of its process>-<random>``:
the reaper, or a later pool, removes those of a process that is gone."""

REAPER = """
import glob, os, shutil, sys, time, psutil
owner, me, seen = psutil.Process(int(sys.argv[1])), psutil.Process(), {}
def ray_process(p):
    name = p.name()
    return name in ("gcs_server", "raylet") or name.startswith("ray::") or any(
        "/ray/" in part for part in p.cmdline())
def owner_gone():
    try:
        return not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
while not owner_gone():
    try:
        children = owner.children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:  # a child gone, or a zombie (no cmdline), is no reason to stop the owner's Ray
            if child.pid != me.pid and child.pid not in seen and ray_process(child):
                seen[child.pid] = child
        except psutil.Error:
            pass
    time.sleep(0.5)
for child in seen.values():
    try:
        child.kill()
    except psutil.Error:
        pass
for directory in glob.glob(sys.argv[2] + "*"):
    shutil.rmtree(directory, ignore_errors=True)
"""
"""The reaper: a process of its own that notes the Ray processes envfleet's process started
and kills them once that process is gone. When the pool's process is killed (SIGKILL: no
``close()``), Ray's own fate sharing stops ``gcs_server`` and the ``raylet``, but its agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) and idle workers were seen running 30 s
later; the reaper ends them within about a second, and removes the pools' socket
directories. Only the owner's own end counts: another of its children that ends (a forked
child, a subprocess: gone, or a zombie without a command line until it is reaped) used to be
taken for it, and the reaper killed the Ray of a process still using it."""


def start() -> None:
    """Start the reaper of the Ray this process just started (:data:`REAPER`)."""
    global _reaper
    try:
        _reaper = subprocess.Popen(
            [sys.executable, "-c", REAPER, str(os.getpid()), socket_dir_prefix(os.getpid())],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not stopped by the Ctrl-C that stops the pool
        )
    except OSError:
        _reaper = None  # Ray's own fate sharing still stops its main daemons


def stop() -> None:
    """Stop the reaper: the Ray it watched was shut down."""
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is not None:
        reaper.kill()
        reaper.wait()


def socket_dir_prefix(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{SOCKET_DIR_PREFIX}{pid}-")


def make_socket_dir() -> str:
    """A new socket directory for this process's pool (mode 0700), after removing those of
    pools whose process is gone (killed: no ``close()``, and no reaper when the Ray was not
    envfleet's own)."""
    temp = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(temp) if name.startswith(SOCKET_DIR_PREFIX)]
    except OSError:
        names = []
    for name in names:
        pid = name[len(SOCKET_DIR_PREFIX) :].partition("-")[0]
        path = os.path.join(temp, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its pool's process is gone (a live pid is never swept)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # not ours to signal, or gone meanwhile
            continue
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")


def forget() -> None:
    """In a forked child: the reaper is the parent's."""
    global _reaper
    _reaper = None


__all__ = [
    "REAPER",
    "SOCKET_DIR_PREFIX",
    "forget",
    "make_socket_dir",
    "socket_dir_prefix",
    "start",
    "stop",
]
