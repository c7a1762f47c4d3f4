"""The bare pool: the least any process pool on envfleet's design can cost, as a runner.

``N`` worker processes (as many as the process backend would start), each holding a block of
the envs: a vector step is a byte to every worker's pipe, a Python loop over its envs in each,
a byte back. No shared-memory batch, no actions sent, no infos, no checks: envfleet process /
bare pool is the price of everything envfleet adds, measured in the same run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Any

import numpy as np

from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import CallRunner, Runner, Timing, Workload
from envfleet.benchmark.runners import _close, _for_loop

BARE_POOL = "bare-pool"
_GO, _STOP, _DONE = b"g", b"s", b"d"


def _bare_worker(
    workload: Workload, count: int, first_index: int, timing: Timing, commands: Any, replies: Any
) -> None:
    """Build ``count`` envs, say ready; then per byte in, one sweep over the envs, one byte out."""
    sweep, actions, envs = _for_loop(workload, count, timing, first_index)
    inbox, outbox = commands.fileno(), replies.fileno()
    try:
        os.write(outbox, _DONE)
        n, k = len(actions), 0
        while os.read(inbox, 1) == _GO:
            sweep(actions[k])
            k = (k + 1) % n
            os.write(outbox, _DONE)
    finally:
        _close(envs)


class BarePool:
    """``num_workers`` processes woken by one byte each per step (see the module docstring)."""

    def __init__(self, workload: Workload, timing: Timing, num_workers: int | None = None) -> None:
        workers = num_workers or min(len(usable_cpus()), workload.num_envs)
        workers = min(workers, workload.num_envs)
        counts = [len(ids) for ids in np.array_split(np.arange(workload.num_envs), workers)]
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        self.num_workers = workers
        ctx = multiprocessing.get_context()
        self._commands: list[int] = []
        self._replies: list[int] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        try:
            for i in range(workers):
                command_r, command_w = ctx.Pipe(duplex=False)
                reply_r, reply_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_bare_worker,
                    args=(workload, counts[i], firsts[i], timing, command_r, reply_w),
                    daemon=True,
                )
                proc.start()
                command_r.close()
                reply_w.close()
                self._conns += [command_w, reply_r]
                self._commands.append(command_w.fileno())
                self._replies.append(reply_r.fileno())
                self._procs.append(proc)
            self._gather()
        except BaseException:
            self.close()
            raise

    def _gather(self) -> None:
        for fd in self._replies:
            if os.read(fd, 1) != _DONE:
                raise RuntimeError("a bare-pool worker died")

    def step(self, _actions: object = None) -> None:
        """One vector step: a byte to every worker, then a byte from every worker."""
        for fd in self._commands:
            os.write(fd, _GO)
        self._gather()

    def close(self) -> None:
        for fd in self._commands:
            with contextlib.suppress(OSError):  # a worker already gone
                os.write(fd, _STOP)
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._commands, self._replies = [], [], [], []


def open_bare_pool(workload: Workload, timing: Timing, num_workers: int | None = None) -> Runner:
    """See :class:`BarePool` (``num_workers``: default as the process backend's)."""
    pool = BarePool(workload, timing, num_workers)
    n = workload.num_envs

    def step() -> int:
        pool.step()
        return n

    return CallRunner(BARE_POOL, step, pool.close, timing, workers=pool.num_workers)
