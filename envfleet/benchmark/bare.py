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


class BarePool:
    """``num_workers`` processes (default: as the process backend's) woken by one byte each per
    step; with ``nodes``, behind that many agents, a node's workers consecutive (see the module
    docstring)."""

    def __init__(
        self, workload: Workload, timing: Timing, num_workers: int | None = None, nodes: int = 0
    ) -> None:
        workers = min(num_workers or len(usable_cpus()), workload.num_envs)
        counts, firsts = blocks(workload.num_envs, workers)
        layout = split_ids(range(workers), nodes) if nodes else [(i,) for i in range(workers)]
        self.num_workers, self.layout = workers, [len(node) for node in layout]
        self.pids: dict[str, list[int]] = {"agents": [], "workers": []}
        """The process ids of its agents (with ``nodes``) and of its workers."""
        self._what = "bare-nodes worker or agent" if nodes else "bare-pool worker"
        self._links: list[tuple[Any, Any]] = []  # per worker or agent: (to it, from it)
        self._procs: list[Any] = []
        ctx = multiprocessing.get_context()
        try:
            for node in layout:
                commands, replies = [], []  # the pool's or the agent's ends of the pipes
                for i in node:
                    command_r, command_w = ctx.Pipe(duplex=False)
                    reply_r, reply_w = ctx.Pipe(duplex=False)
                    args = (workload, counts[i], firsts[i], timing, command_r, reply_w)
                    self._start(ctx, "workers", _bare_worker, args, command_r, reply_w)
                    commands.append(command_w)
                    replies.append(reply_r)
                if not nodes:
                    self._links.append((commands[0], replies[0]))
                    continue
                near, far = _loopback_pair()
                self._links.append((near, near))
                self._start(ctx, "agents", _bare_agent, (far, commands, replies), far, *commands)
                for end in replies:  # like its other ends here, the agent's alone
                    end.close()
            self._gather()
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, role: str, target: Any, args: tuple[Any, ...], *ends: Any) -> None:
        """Start ``target(*args)``, then close ``ends`` here (the new process's alone)."""
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self._procs.append(proc)
        self.pids[role].append(proc.pid)
        for end in ends:
            end.close()

    def _gather(self) -> None:
        for _, inbox in self._links:
            if os.read(inbox.fileno(), 1) != _DONE:
                raise RuntimeError(f"a {self._what} died")

    def step(self, _actions: object = None) -> None:
        """One vector step: a byte to every worker (or agent), then a byte from every one."""
        for outbox, _ in self._links:
            os.write(outbox.fileno(), _GO)
        self._gather()

    def close(self) -> None:
        for outbox, _ in self._links:
            with contextlib.suppress(OSError):  # already gone
                os.write(outbox.fileno(), _STOP)
        for proc in self._procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for ends in self._links:
            for end in set(ends):
                end.close()
        self._procs, self._links = [], []


class BareNodePool(BarePool):
    """``nodes`` agent processes, each with ``workers_per_node`` bare workers (see the module
    docstring); the envs split over all the workers in order, a node's workers consecutive."""

    def __init__(
        self, workload: Workload, timing: Timing, nodes: int, workers_per_node: int
    ) -> None:
        if nodes < 1 or workers_per_node < 1:
            raise ValueError(
                f"nodes and workers_per_node must be >= 1, got {nodes} and {workers_per_node}"
            )
        super().__init__(workload, timing, nodes * workers_per_node, nodes)


def _runner(name: str, pool: BarePool, workload: Workload, timing: Timing, **info: Any) -> Runner:
    """A runner of a bare pool's ``step`` (a vector step of every env)."""
    n = workload.num_envs

    def advance() -> int:
        pool.step()
        return n

    return CallRunner(name, advance, pool.close, timing, **info)


def open_bare_pool(workload: Workload, timing: Timing, num_workers: int | None = None) -> Runner:
    """See :class:`BarePool` (``num_workers``: default as the process backend's)."""
    pool = BarePool(workload, timing, num_workers)
    return _runner(BARE_POOL, pool, workload, timing, workers=pool.num_workers)


def open_bare_nodes(
    workload: Workload, timing: Timing, nodes: int = 2, workers_per_node: int = 4
) -> Runner:
    """See :class:`BareNodePool`."""
    pool = BareNodePool(workload, timing, nodes, workers_per_node)
    return _runner(BARE_NODES, pool, workload, timing, nodes=pool.layout)


__all__ = [
    "BARE_NODES",
    "BARE_POOL",
    "BareNodePool",
    "BarePool",
    "open_bare_nodes",
    "open_bare_pool",
]
