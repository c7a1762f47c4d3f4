"""The bare layouts: what a pool of envfleet's design must do and nothing else, as runners.

One node (:class:`BarePool`): worker processes, each holding a consecutive block of the envs,
over one batch in shared memory (actions, observations, rewards, terminated, truncated). A
step writes the actions into the batch and a byte to every worker; each worker steps its envs
with their actions (one whose episode ended is reset instead: Gymnasium's ``NEXT_STEP``
autoreset), writes their rows into the batch and a byte back. No infos, checks or recovery.

Across nodes (``nodes=k``): an agent process per node, its workers its children on a batch of
its own. A step is one TCP message to each agent with its envs' actions, written into its
batch before it wakes its workers, and one back with their rows, which the pool writes into
its batch with one assignment per field: what node sub-pools must do, on whatever machine.

Processes are forked (the envs need not pickle); env ``i`` is reset with ``seed + i``.
:func:`open_bare_threads` is the least a pool of Python threads can do.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import socket
import struct
import threading
from typing import Any

import numpy as np
from gymnasium import spaces

from envfleet.affinity import usable_cpus
from envfleet.benchmark.base import (
    CallRunner,
    Runner,
    Timing,
    Workload,
    cycle,
    join_all,
    sample_actions,
)
from envfleet.threads import split_ids

BARE_POOL = "bare-pool"
FIELDS = ("obs", "rewards", "terminated", "truncated")
"""The rows a step writes, in the order a node's answer carries them."""
_GO, _STOP, _DONE = b"g", b"s", b"d"
_CTX = multiprocessing.get_context("fork")


class _Batch:
    """Shared arrays for ``count`` envs, by name: ``actions`` and :data:`FIELDS`."""

    def __init__(self, obs_space: Any, act_space: Any, count: int) -> None:
        layout = {
            "actions": (act_space.shape, act_space.dtype),
            "obs": (obs_space.shape, obs_space.dtype),
            "rewards": ((), np.float64),
            "terminated": ((), np.bool_),
            "truncated": ((), np.bool_),
        }
        self.arrays: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in layout.items():
            size = count * math.prod(shape) * np.dtype(dtype).itemsize
            raw = _CTX.RawArray(ctypes.c_byte, max(1, size))
            flat = np.frombuffer(memoryview(raw).cast("B"), np.uint8, size)
            self.arrays[name] = flat.view(dtype).reshape(count, *shape)

    def rows(self) -> tuple[np.ndarray, ...]:
        return tuple(self.arrays[name] for name in FIELDS)


def _worker(
    workload: Workload, first: int, seed: int, batch: _Batch, block: slice, fds: tuple[int, ...]
) -> None:
    """Build the envs of ``block``, say ready; then per byte in (``fds[0]``), a step of each
    env with its action (a reset where its episode ended), its rows into ``batch``, a byte out
    (``fds[1]``). ``fds[2:]``: the pool's ends, closed here."""
    inbox, outbox = fds[:2]
    for fd in fds[2:]:
        os.close(fd)
    envs: list[Any] = []
    try:
        for i in range(block.start, block.stop):
            envs.append(workload.build())
            envs[-1].reset(seed=seed + first + i)
        discrete = isinstance(envs[0].action_space, spaces.Discrete)
        actions, obs, rewards, terminated, truncated = (
            batch.arrays[name][block] for name in ("actions", *FIELDS)
        )
        done = [False] * len(envs)
        os.write(outbox, _DONE)
        while os.read(inbox, 1) == _GO:
            results = []
            for j, (env, action) in enumerate(
                zip(envs, actions.tolist() if discrete else list(actions), strict=True)
            ):
                if done[j]:
                    obs[j] = env.reset()[0]
                    results.append((0.0, False, False))
                else:
                    o, r, t, u, _ = env.step(action)
                    obs[j] = o
                    results.append((r, t, u))
            rewards[:], terminated[:], truncated[:] = zip(*results, strict=True)
            done = [t or u for _, t, u in results]
            os.write(outbox, _DONE)
    finally:
        for env in envs:
            env.close()


class _Workers:
    """``num_workers`` forked workers over ``batch`` (envs ``first`` to ``first + count``,
    consecutive blocks as the pool splits them); :meth:`run` is one step of them all."""

    def __init__(
        self, workload: Workload, seed: int, first: int, batch: _Batch, count: int, num_workers: int
    ) -> None:
        self._procs: list[Any] = []
        self._ends: list[tuple[int, int]] = []  # per worker: (to it, from it)
        try:
            for ids in split_ids(range(count), num_workers):
                (command_r, command_w), (reply_r, reply_w) = os.pipe(), os.pipe()
                self._ends.append((command_w, reply_r))
                fds = (command_r, reply_w, command_w, reply_r)
                block = slice(ids[0], ids[-1] + 1)
                args = (workload, first, seed, batch, block, fds)
                proc = _CTX.Process(target=_worker, args=args, daemon=True)
                try:
                    proc.start()
                finally:
                    os.close(command_r)
                    os.close(reply_w)
                self._procs.append(proc)
            self._gather()
        except BaseException:
            self.close()
            raise
        self.pids = [proc.pid for proc in self._procs]

    def _gather(self) -> None:
        for _, inbox in self._ends:
            if os.read(inbox, 1) != _DONE:
                raise RuntimeError("a bare worker died")

    def run(self) -> None:
        for outbox, _ in self._ends:
            os.write(outbox, _GO)
        self._gather()

    def close(self) -> None:
        for outbox, _ in self._ends:
            with contextlib.suppress(OSError):  # already gone
                os.write(outbox, _STOP)
        join_all(self._procs)
        for ends in self._ends:
            for fd in ends:
                os.close(fd)
        self._procs, self._ends = [], []


def _recv_exactly(link: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``link``; ``False`` if it closed before a byte came."""
    got = 0
    while got < len(view):
        n = link.recv_into(view[got:])
        if not n:
            if got:
                raise ConnectionError("the connection closed mid-message")
            return False
        got += n
    return True


def _send_all(link: socket.socket, views: list[memoryview]) -> None:
    """``views`` as one message (a gathered write; what it left unsent, after)."""
    sent = link.sendmsg(views)
    if sent < sum(len(v) for v in views):
        link.sendall(b"".join(views)[sent:])


def _bytes(array: np.ndarray) -> memoryview:
    return array.data.cast("B")


def _agent(
    link: socket.socket,
    others: list[socket.socket],
    workload: Workload,
    seed: int,
    first: int,
    count: int,
    workers: int,
    nice: int | None,
) -> None:
    """A node's agent: its workers on a batch of its own, their pids sent; then per message of
    actions, a step of its workers, their rows back in one message, until the link closes.
    ``others``: the pool's ends of links, closed here (so that each closes with the pool's);
    ``nice``: its and its workers' niceness (``None``: the pool's)."""
    for end in others:
        end.close()
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    probe = workload.build()
    batch = _Batch(probe.observation_space, probe.action_space, count)
    probe.close()
    pool = _Workers(workload, seed, first, batch, count, workers)
    try:
        link.sendall(struct.pack(f"<{workers}q", *pool.pids))
        actions = _bytes(batch.arrays["actions"])
        rows = [_bytes(field) for field in batch.rows()]
        while _recv_exactly(link, actions):
            pool.run()
            _send_all(link, rows)
    finally:
        pool.close()
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
    """``num_workers`` bare workers (default: as the process backend's), with ``nodes`` behind
    that many agents at niceness ``nice`` (Ray runs its actors at 15); see the module
    docstring. :meth:`step` takes a batch of actions and returns the rows, views of the batch."""

    def __init__(
        self,
        workload: Workload,
        timing: Timing,
        num_workers: int | None = None,
        nodes: int = 0,
        nice: int | None = None,
    ) -> None:
        n = workload.num_envs
        if nodes < 0 or (num_workers is not None and num_workers < max(1, nodes)):
            raise ValueError(f"{num_workers} workers cannot serve {nodes} nodes")
        workers = min(num_workers or len(usable_cpus()), n)
        probe = workload.build()
        self.single_action_space = probe.action_space
        self.batch = _Batch(probe.observation_space, probe.action_space, n)
        probe.close()
        per_node = split_ids(range(workers), nodes) if nodes else [tuple(range(workers))]
        self.num_workers, self.layout = workers, [len(node) for node in per_node]
        self.pids: dict[str, list[int]] = {"agents": [], "workers": []}
        self._local: _Workers | None = None
        self._agents: list[Any] = []
        self._links: list[tuple[socket.socket, slice, memoryview, list[np.ndarray]]] = []
        seed = timing.seed
        try:
            if not nodes:
                self._local = _Workers(workload, seed, 0, self.batch, n, workers)
                self.pids["workers"] = self._local.pids
                return
            env_blocks = split_ids(range(n), workers)
            for node in per_node:
                envs = [i for w in node for i in env_blocks[w]]
                block = slice(envs[0], envs[-1] + 1)
                self._open_agent(workload, seed, block, len(node), nice)
        except BaseException:
            self.close()
            raise

    def _open_agent(
        self, workload: Workload, seed: int, block: slice, workers: int, nice: int | None
    ) -> None:
        near, far = _loopback_pair()
        count = block.stop - block.start
        others = [near, *(link for link, *_ in self._links)]
        args = (far, others, workload, seed, block.start, count, workers, nice)
        # Not a daemon (its workers are its children): it ends when its link closes.
        agent = _CTX.Process(target=_agent, args=args)
        agent.start()
        far.close()
        self._agents.append(agent)
        self.pids["agents"].append(agent.pid or 0)
        pids = bytearray(8 * workers)
        if not _recv_exactly(near, memoryview(pids)):
            near.close()
            raise RuntimeError("a bare-nodes worker or agent died")
        self.pids["workers"] += list(struct.unpack(f"<{workers}q", pids))
        rows = [field[block] for field in self.batch.rows()]
        answer = bytearray(sum(field.nbytes for field in rows))
        views, at = [], 0
        for field in rows:
            views.append(np.frombuffer(answer, field.dtype, field.size, at).reshape(field.shape))
            at += field.nbytes
        self._links.append((near, block, memoryview(answer), views))

    def step(self, actions: Any) -> tuple[np.ndarray, ...]:
        """One vector step of every env with ``actions``; the rows, views of the batch."""
        batch = self.batch.arrays
        if self._local is not None:
            batch["actions"][:] = actions
            self._local.run()
            return self.batch.rows()
        actions = np.ascontiguousarray(actions, batch["actions"].dtype)
        for link, block, _, _ in self._links:
            link.sendall(_bytes(actions[block]))
        for link, block, answer, views in self._links:
            if not _recv_exactly(link, answer):
                raise RuntimeError("a bare-nodes agent died")
            for name, view in zip(FIELDS, views, strict=True):
                batch[name][block] = view
        return self.batch.rows()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        for link, *_ in self._links:
            link.close()
        join_all(self._agents)
        self._links, self._agents = [], []


def open_bare_pool(workload: Workload, timing: Timing, num_workers: int | None = None) -> Runner:
    """A runner of :class:`BarePool` on one node stepped with sampled actions (``num_workers``:
    default as the process backend's)."""
    pool = BarePool(workload, timing, num_workers)
    try:
        actions = sample_actions(pool.single_action_space, workload.num_envs, timing)
    except BaseException:
        pool.close()
        raise
    advance = cycle(pool.step, actions, workload.num_envs)
    return CallRunner(BARE_POOL, advance, pool.close, timing, workers=pool.num_workers)


def open_bare_threads(workload: Workload, timing: Timing) -> Runner:
    """The least any Python thread pool can do: a thread per env, every step started by one
    write to a shared eventfd (semaphore mode: each thread takes one), its end signalled by the
    last thread through a lock; no actions, no results, no error handling."""
    envs = [workload.build() for _ in range(workload.num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=timing.seed + i)
    bell = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC)
    done, count_lock, stop = threading.Lock(), threading.Lock(), threading.Event()
    done.acquire()
    left = [0]

    def serve(env: Any) -> None:
        while True:
            os.eventfd_read(bell)
            if stop.is_set():
                return
            env.step(0)
            with count_lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done.release()

    threads = [threading.Thread(target=serve, args=(env,), daemon=True) for env in envs]
    for thread in threads:
        thread.start()

    def advance() -> int:
        left[0] = len(envs)
        os.eventfd_write(bell, len(envs))
        done.acquire()
        return len(envs)

    def close() -> None:
        stop.set()
        os.eventfd_write(bell, len(envs))
        for thread in threads:
            thread.join(1.0)
        os.close(bell)
        for env in envs:
            env.close()

    return CallRunner("bare-threads", advance, close, timing, threads=len(envs))


__all__ = [
    "BARE_POOL",
    "FIELDS",
    "BarePool",
    "open_bare_pool",
    "open_bare_threads",
]
