"""The process backend's worker processes as a set: waiting for them to build their envs, and
for them to exit once told to close.

Each wait is bounded (``start_timeout``, the close timeout) and watches only the workers it
waits for, through their reply pipes and process sentinels: a worker restarted mid-run leaves
the other workers' replies in their pipes for the pool's next wait.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import time
from collections.abc import Sequence
from typing import Any

from envfleet.backends.contract.base import TransportOptions
from envfleet.backends.local.worker_process import WorkerProcess, describe_exit
from envfleet.errors import EnvTimeoutError, Phase, WorkerDiedError
from envfleet.protocol import Reply

__all__ = ["await_built", "start_failed", "wait_for_exit"]


def start_failed(
    slot: WorkerProcess,
    kind: type[WorkerDiedError],
    worker: int,
    what: str,
    options: TransportOptions,
) -> WorkerDiedError:
    """The error for ``worker`` (``slot``) that could not build its envs (``what`` happened)."""
    return kind(
        f"worker {worker} {what}",
        env_index=None,
        phase=Phase.MAKE,
        worker=worker,
        exitcode=slot.proc.exitcode,
        env_ids=tuple(options.assignment[worker]),
    )


def await_built(
    slots: Sequence[WorkerProcess], workers: Sequence[int], options: TransportOptions
) -> None:
    """Wait for each of ``workers`` (indices into ``slots``) to report its envs built, all
    within ``options.start_timeout``; a worker still building then is killed.

    Raises:
        EnvTimeoutError: a worker did not build its envs in time.
        WorkerDiedError: a worker died while building them.
        EnvError: an env's constructor raised (its own error, naming the env).
    """
    deadline = time.monotonic() + options.start_timeout
    for worker in workers:
        slot = slots[worker]
        proc = slot.proc
        got: list[Reply | None] = []
        lost = False
        while not got and not lost:
            remaining = max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([slot.reply_fd, slot.sentinel], remaining)
            if not ready:
                proc.kill()  # still building its envs: a constructor that hangs
                proc.join(1.0)
                raise start_failed(
                    slot,
                    EnvTimeoutError,
                    worker,
                    f"did not build its envs {list(options.assignment[worker])} "
                    f"within start_timeout={options.start_timeout:g}s; killed",
                    options,
                )
            lost = not slot.read(got)
        if not got:
            proc.join(1.0)
            raise start_failed(
                slot,
                WorkerDiedError,
                worker,
                f"died while building its envs {list(options.assignment[worker])} "
                f"({describe_exit(proc.exitcode)})",
                options,
            )
        reply = got[0]
        if reply is not None and reply.failures:
            raise reply.failures[0].to_error(worker, options.spec.name)


def wait_for_exit(slots: Sequence[WorkerProcess], timeout: float) -> None:
    """Wait up to ``timeout`` for the processes of ``slots``, told to close, to exit: writing
    what waits in their outboxes (a close queued behind a large command) and draining their
    replies, so that no worker blocks writing to a full pipe while it exits."""
    deadline = time.monotonic() + timeout
    while any(slot.proc.is_alive() for slot in slots):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for slot in slots:
            if slot.outbox and slot.alive:
                slot.outbox.flush()
        running = [slot for slot in slots if slot.proc.is_alive()]
        reply_fds = {slot.reply_fd for slot in running}
        handles: list[Any] = [slot.reply_fd for slot in running]
        handles += [slot.sentinel for slot in running]
        for handle in multiprocessing.connection.wait(handles, min(remaining, 0.1)):
            if handle in reply_fds:
                with contextlib.suppress(OSError):
                    while os.read(handle, 1 << 16):
                        pass
