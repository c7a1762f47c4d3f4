"""The bare pools: the least any pool on envfleet's design can cost, as runners.

The bare pool: ``N`` worker processes (as many as the process backend would start), each
holding a block of the envs: a vector step is a byte to every worker's pipe, a Python loop over
its envs in each, a byte back. No shared-memory batch, no actions sent, no infos, no checks:
envfleet process / bare pool is the price of everything envfleet adds, measured in the same run.

The bare node pool: the same workers behind one agent process per node, as node sub-pools lay
them out (``backend="ray"`` on a cluster): a vector step is a byte to every agent over a TCP
connection, a byte from each agent to each of its workers' pipes, a byte back from each worker
and a byte from each agent. No Ray, no rows, no actions: what the topology itself costs on the
machine it runs on (on one machine, every process of every "node" shares its cores).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
from collections.abc import Callable
from typing import Any

from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import CallRunner, Runner, Timing, Workload
from envfleet.benchmark.runners import _close, _for_loop, blocks
from envfleet.threads import split_ids

BARE_POOL = "bare-pool"
BARE_NODES = "bare-nodes"
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
        counts, firsts = blocks(workload.num_envs, workers)
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
        _stop(self._commands, self._procs)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._commands, self._replies = [], [], [], []


def _stop(fds: list[int], procs: list[Any]) -> None:
    """Ask each process behind ``fds`` to stop, and see that every one of ``procs`` has ended."""
    for fd in fds:
        with contextlib.suppress(OSError):  # already gone
            os.write(fd, _STOP)
    for proc in procs:
        proc.join(timeout=10.0)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def _runner(
    name: str,
    step: Callable[[], object],
    close: Callable[[], object],
    workload: Workload,
    timing: Timing,
    **info: Any,
) -> Runner:
    """A runner of a bare pool's ``step`` (a vector step of every env)."""
    n = workload.num_envs

    def advance() -> int:
        step()
        return n

    return CallRunner(name, advance, close, timing, **info)


def open_bare_pool(workload: Workload, timing: Timing, num_workers: int | None = None) -> Runner:
    """See :class:`BarePool` (``num_workers``: default as the process backend's)."""
    pool = BarePool(workload, timing, num_workers)
    return _runner(BARE_POOL, pool.step, pool.close, workload, timing, workers=pool.num_workers)


def _bare_agent(link: socket.socket, commands: list[Any], replies: list[Any]) -> None:
    """A node's agent: its workers' ready bytes, then per byte from the pool a byte to each of
    its workers, a byte from each, a byte back; it ends (closing ``link``) when a worker does."""
    pool = link.fileno()
    outboxes = [c.fileno() for c in commands]
    inboxes = [r.fileno() for r in replies]
    try:
        if all(os.read(fd, 1) == _DONE for fd in inboxes):
            os.write(pool, _DONE)
            while os.read(pool, 1) == _GO:
                for fd in outboxes:
                    os.write(fd, _GO)
                if not all(os.read(fd, 1) == _DONE for fd in inboxes):
                    break
                os.write(pool, _DONE)
    finally:
        for fd in outboxes:
            with contextlib.suppress(OSError):  # a worker already gone
                os.write(fd, _STOP)
        link.close()


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a TCP connection on the loopback address, Nagle off, as a node agent's."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    for end in (near, far):
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return near, far


class BareNodePool:
    """``nodes`` agent processes, each with ``workers_per_node`` bare workers (see the module
    docstring); the envs split over all the workers in order, a node's workers consecutive."""

    def __init__(
        self, workload: Workload, timing: Timing, nodes: int, workers_per_node: int
    ) -> None:
        if nodes < 1 or workers_per_node < 1:
            raise ValueError(
                f"nodes and workers_per_node must be >= 1, got {nodes} and {workers_per_node}"
            )
        workers = min(nodes * workers_per_node, workload.num_envs)
        counts, firsts = blocks(workload.num_envs, workers)
        layout = split_ids(range(workers), nodes)  # a node's workers: consecutive
        self.layout = [len(node) for node in layout]
        self.pids: dict[str, list[int]] = {"agents": [], "workers": []}
        """The process ids of its agents and of its workers."""
        ctx = multiprocessing.get_context()
        self._links: list[socket.socket] = []
        self._procs: list[Any] = []
        try:
            for node in layout:
                # The agent's ends of its workers' pipes.
                commands: list[Any] = []
                replies: list[Any] = []
                for i in node:
                    command_r, command_w = ctx.Pipe(duplex=False)
                    reply_r, reply_w = ctx.Pipe(duplex=False)
                    commands.append(command_w)
                    replies.append(reply_r)
                    self._start(
                        ctx,
                        "workers",
                        _bare_worker,
                        (workload, counts[i], firsts[i], timing, command_r, reply_w),
                    )
                    command_r.close()  # the worker's alone: its death is the agent's EOF
                    reply_w.close()
                near, far = _loopback_pair()
                self._links.append(near)
                self._start(ctx, "agents", _bare_agent, (far, commands, replies))
                far.close()  # the agent's alone, as are its ends of the pipes
                for end in (*commands, *replies):
                    end.close()
            self._gather()
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, role: str, target: Any, args: tuple[Any, ...]) -> None:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self._procs.append(proc)
        self.pids[role].append(proc.pid)

    def _gather(self) -> None:
        for link in self._links:
            if os.read(link.fileno(), 1) != _DONE:
                raise RuntimeError("a bare-nodes worker or agent died")

    def step(self, _actions: object = None) -> None:
        """One vector step: a byte to every agent, then a byte from every agent."""
        for link in self._links:
            os.write(link.fileno(), _GO)
        self._gather()

    def close(self) -> None:
        _stop([link.fileno() for link in self._links], self._procs)
        for link in self._links:
            link.close()
        self._procs, self._links = [], []


def open_bare_nodes(
    workload: Workload, timing: Timing, nodes: int = 2, workers_per_node: int = 4
) -> Runner:
    """See :class:`BareNodePool`."""
    pool = BareNodePool(workload, timing, nodes, workers_per_node)
    return _runner(BARE_NODES, pool.step, pool.close, workload, timing, nodes=pool.layout)
