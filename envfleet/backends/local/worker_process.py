"""The pool's handle on one worker process of the process backend.

A :class:`WorkerProcess` is the process and the pool's ends of its two one-way pipes: commands
go out through its :class:`~envfleet.backends.contract.outbox.Outbox` (never blocking the
pool), replies come in through a non-blocking read framed by
:class:`~envfleet.backends.contract.framing.FrameReader`,
and its end is seen through the process sentinel. It starts the process, reads what it sent,
buries it once it is gone (keeping the replies it sent before dying) and stops it.
:func:`worker_main` is what runs in the process; how the pool waits on many of them together is
:mod:`envfleet.backends.local.process`'s business.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from envfleet.backends.contract import spares as spare_rows
from envfleet.backends.contract.base import TransportOptions, WorkerLost
from envfleet.backends.contract.channel import serve_pipes
from envfleet.backends.contract.framing import FrameReader, encode_reply, write_all
from envfleet.backends.contract.outbox import Outbox
from envfleet.backends.contract.rows import Shipping
from envfleet.backends.local import wake_order
from envfleet.backends.local.lifeline import die_with_parent
from envfleet.buffers import SharedBatch
from envfleet.errors import Phase
from envfleet.guards import claim_base_exceptions
from envfleet.info_columns import Columns
from envfleet.protocol import Command, EnvFailure, Reply
from envfleet.worker import start_group

SPIN_SECONDS = 0.0
"""How long each side polls without sleeping before it blocks in the kernel: 0 (block at once)
measured fastest on 2 cores, where a spinning parent or worker takes the core an env needs
(docs/benchmarks.md, "Waiting strategy"). Raise it only with more cores than busy processes."""


def worker_main(
    worker: int,
    commands: Connection,
    replies: Connection,
    parent_ends: tuple[Connection, Connection] | None,
    options_blob: bytes,
    shared: SharedBatch,
    parent_pid: int,
    restarts: dict[int, int],
    from_main_thread: bool = False,
    spares_raw: tuple[Any, ...] = (),
    wake_raw: Any = None,
) -> None:
    """What a worker process runs: build its envs (``options.assignment[worker]``) over the
    shared batch, say so, then serve the pool's commands until it closes or goes away."""
    # Ctrl-C goes to the whole process group: the parent alone handles it and closes us. So a
    # KeyboardInterrupt here is an env's own, its failure like any other exception.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    claim_base_exceptions()
    if parent_ends is not None:
        for end in parent_ends:
            end.close()  # so that our read sees EOF once the parent is gone
    die_with_parent(parent_pid, from_main_thread)
    reply_fd = replies.fileno()
    try:
        # cloudpickle: the env factory may be a lambda or closure, under any start method.
        options: TransportOptions = pickle.loads(options_blob)
    except Exception as exc:  # e.g. the factory's module cannot be imported in this process
        write_all(
            reply_fd, encode_reply(Reply(failures=(EnvFailure.capture(None, Phase.MAKE, exc),)))
        )
        return
    batch = shared.views()
    group, started = start_group(
        options,
        options.assignment[worker],
        batch,
        restarts=restarts,
        rebuild_timeout=options.start_timeout,  # a process of our own: it may end itself
    )
    write_all(reply_fd, encode_reply(started))
    if group is None:
        return
    if shared.observations is None:  # a space shared memory cannot hold: they travel pickled
        group = Shipping(group, batch, options.observation_space)
    after = wake_order.then(
        spare_rows.copier(
            options.observation_space,
            options.num_envs,
            options.assignment[worker],
            spares_raw,
            batch.observations,
        ),
        wake_order.noter(wake_raw, worker),
    )
    serve_pipes(group, commands.fileno(), reply_fd, SPIN_SECONDS, after)


ONE_PLAIN: list[Reply | None] = [None]
"""What :meth:`WorkerProcess.read` gives after most steps: one plain reply."""


@dataclass(eq=False)
class WorkerProcess:
    """One worker process and the pool's ends of its pipes."""

    proc: BaseProcess
    ends: tuple[Connection, Connection]  # (command writer, reply reader)
    command_fd: int
    reply_fd: int
    sentinel: int  # the process's sentinel (read on every wait)
    outbox: Outbox  # commands its pipe had no room for yet
    reader: FrameReader = field(default_factory=FrameReader)
    last: Command | None = None  # the command it would repeat
    alive: bool = True
    alone: select.poll | None = None  # its reply pipe and sentinel alone

    @classmethod
    def start(
        cls,
        ctx: Any,
        worker: int,
        target: Callable[..., None],
        args: tuple[Any, ...],
        watcher: Callable[[int], Callable[[bool], None]],
        infos: Callable[[Columns], None] | None = None,
    ) -> WorkerProcess:
        """Start process ``worker`` of context ``ctx`` running ``target(worker, command
        reader, reply writer, (the pool's ends), *args)``.

        ``watcher(command_fd)`` gives what the worker's outbox calls when bytes start or stop
        waiting in it; ``infos`` takes the infos it sends as columns (its replies' dicts
        otherwise).
        """
        command_r, command_w = ctx.Pipe(duplex=False)
        reply_r, reply_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=target,
            name=f"envfleet-worker-{worker}",
            args=(worker, command_r, reply_w, (command_w, reply_r), *args),
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:
            for end in (command_r, command_w, reply_r, reply_w):
                end.close()
            raise
        command_r.close()
        reply_w.close()  # so that the worker's death reads as EOF here
        os.set_blocking(reply_r.fileno(), False)
        # A write never blocks the pool: what does not fit waits in the worker's outbox, so a
        # hung worker cannot hold up a submit beyond step_timeout (nor deadlock against a
        # worker blocked writing a large reply).
        command_fd = command_w.fileno()
        os.set_blocking(command_fd, False)
        return cls(
            proc,
            (command_w, reply_r),
            command_fd,
            reply_r.fileno(),
            proc.sentinel,
            Outbox(functools.partial(os.write, command_fd), watcher(command_fd)),
            FrameReader(infos),
        )

    def poll_alone(self, timeout_ms: int) -> list[tuple[int, int]]:
        """Wait up to ``timeout_ms`` for this worker alone: its reply pipe or its sentinel
        readable; the events."""
        if self.alone is None:
            self.alone = select.poll()
            self.alone.register(self.reply_fd, select.POLLIN)
            self.alone.register(self.sentinel, select.POLLIN)
        return self.alone.poll(timeout_ms)

    def read(self, out: list[Reply | None]) -> bool:
        """Read what the reply pipe holds into ``out``; False at EOF (the worker is gone)."""
        return self.reader.read(self.reply_fd, out)

    def bury(self, out: list[Reply | None]) -> WorkerLost:
        """The worker is gone (or going): reap its process, read into ``out`` what it sent
        before it exited, and say how it ended."""
        proc = self.proc
        if proc.is_alive():  # EOF without an exit: give it a moment to finish dying
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
        proc.join(1.0)
        self.read(out)  # what came between the pool's last read and the exit
        self.alive = False
        self.outbox.drop()
        return WorkerLost(proc.exitcode, describe_exit(proc.exitcode))

    def discard(self) -> None:
        """Kill the process (alive or not) and release it and its pipes: it is replaced."""
        self.alive = False
        self.outbox.drop()
        proc = self.proc
        if proc.is_alive():
            proc.kill()
        proc.join(1.0)
        for end in self.ends:
            end.close()
        proc.close()

    def stop(self) -> None:
        """End the process if it has not ended by itself (terminate, then kill) and release it
        and its pipes."""
        proc = self.proc
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
        try:
            proc.close()
        except ValueError:  # reaped by a wait of another thread (close() from a thread)
            pass
        for end in self.ends:
            end.close()
        self.alive = False

    def memory(self) -> int | None:
        """Resident memory of the process in bytes (``None``: gone or unknown)."""
        if not self.alive:
            return None
        import psutil  # only worker_memory_limit asks: `make` alone does not import it

        try:
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        except (psutil.Error, ValueError):
            return None


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words (its exit code or the signal that killed it)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


__all__ = ["ONE_PLAIN", "SPIN_SECONDS", "WorkerProcess", "describe_exit", "worker_main"]
