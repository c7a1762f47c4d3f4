"""The Ray backend's actor: one worker's group of envs, served by Ray calls or over a socket.

An actor on the pool's machine maps the pool's batch memory and serves commands from a Unix
socket (:meth:`GroupActor.serve`, the process backend's loop); one elsewhere keeps arrays of
its own and answers each command as a Ray call (:meth:`GroupActor.run`), its results packed in
arrays (:data:`Packed`), or pickled and cut in pieces that Ray returns inline
(:meth:`GroupActor.run_chunked`). The pool's side is :mod:`envfleet.backends.ray.transport`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
from collections.abc import Mapping
from typing import Any

import cloudpickle
import numpy as np
import ray

from envfleet.backends.contract.base import TransportOptions
from envfleet.backends.contract.channel import serve_connection
from envfleet.backends.contract.connections import accept_pool, open_listener
from envfleet.backends.contract.replies import beyond_infos, unpicklable
from envfleet.backends.contract.rows import Shipping, deliver, pack
from envfleet.backends.ray.memory import NodeMemory
from envfleet.buffers import Batch, ObjectRows
from envfleet.guards import claim_base_exceptions
from envfleet.protocol import Command, EnvCommand, Group, Reply, Rows
from envfleet.worker import run_command, start_group

Packed = tuple[
    np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray, "Mapping[int, dict[str, Any]] | None"
]
"""A step's or reset's reply with nothing but results: ``(env_ids, observations, rewards,
terminations, truncations, infos)``, rows in ``env_ids`` order."""


class GroupActor:
    """The actor: one group of envs, and the batch arrays it writes its rows of.

    On the pool's machine those are the pool's own (mapped from its memory file) and the actor
    serves commands from a socket (:meth:`serve`); elsewhere they are ``np.zeros`` of the full
    pool size, of which only this actor's rows are ever touched (untouched zero pages cost no
    memory), and each command is a Ray call (:meth:`run`). An actor that replaces a lost one
    there starts from its envs' rows as the pool holds them (``rows``, see
    :meth:`~envfleet.backends.ray.transport.RayTransport.restart`), not from zeros.
    """

    def __init__(
        self,
        options: TransportOptions,
        worker: int,
        restarts: dict[int, int],
        rows: Rows | None = None,
    ) -> None:
        # An actor's process is a worker of its own: a KeyboardInterrupt there is an env's (the
        # user's Ctrl-C reaches the pool's process), its failure like any other exception.
        claim_base_exceptions()
        self.options = options
        self.worker = worker
        self.restarts = restarts
        self.rows = rows  # a replacement's: its envs' rows as the pool holds them
        self.batch = Batch.local(options.observation_space, options.action_space, 0)
        self.group: Group | None = None
        self._memory: mmap.mmap | None = None  # keeps the pool's memory mapped
        self._listener: socket.socket | None = None
        self._socket_dir: str | None = None
        self._socket_file: str | None = None  # a socket in the pool's directory
        self._authkey = b""

    def start(
        self,
        memory: NodeMemory | None,
        pool_node: str | None,
        authkey: bytes,
        socket_dir: str | None = None,
    ) -> tuple[Reply, str, str | None, int]:
        """Build the envs; return the outcome, this actor's node, on the pool's machine the
        socket address to serve the pool on (``None``: use Ray calls), and this actor's process
        id (the pool reads its memory, ``worker_memory_limit``). The socket goes in
        ``socket_dir``, the pool's private directory, when it can."""
        options = self.options
        node = str(ray.get_runtime_context().get_node_id())
        shared = False
        if memory is not None and node == pool_node:
            try:
                self.batch, self._memory = memory.attach()
                shared = True
            except OSError:
                pass  # not the pool's machine after all, or no access: Ray calls it is
        if not shared:
            self.batch = Batch.local(
                options.observation_space, options.action_space, options.num_envs
            )
            if self.rows is not None:  # where they stand: a restarted env's latest stands
                deliver(self.batch, options.observation_space, Reply(rows=self.rows))
        self.rows = None
        self.group, started = start_group(
            options,
            options.assignment[self.worker],
            self.batch,
            restarts=self.restarts,
            rebuild_timeout=options.start_timeout,  # an actor's own process may end itself
        )
        if self.group is None:
            return started, node, None, os.getpid()
        if shared and isinstance(self.batch.observations, ObjectRows):
            # Observations of a space shared memory cannot hold travel pickled, the rest not.
            self.group = Shipping(self.group, self.batch, options.observation_space)
        address = None
        if shared:
            # A socket in a directory only this user may enter (else an abstract one); the key
            # keeps out whoever else connects, and a stranger cannot hold the actor up.
            try:
                self._listener, address, self._socket_dir = open_listener(socket_dir)
                self._socket_file = address if self._socket_dir is None else None
                self._authkey = authkey
            except OSError:
                pass  # no socket here (a sandbox, say): Ray calls, on the shared rows all the same
        return Reply(), node, address, os.getpid()

    def serve(self) -> None:
        """Serve the pool's commands from the socket until it closes the pool (or goes away)."""
        assert self._listener is not None and self.group is not None
        try:
            conn = accept_pool(self._listener, self._authkey)
        finally:
            self._close_listener()
        with conn:
            serve_connection(self.group, conn)

    def _close_listener(self) -> None:
        """Close the listening socket and remove its file and directory (once connected)."""
        listener, self._listener = getattr(self, "_listener", None), None
        if listener is not None:
            listener.close()
        directory, self._socket_dir = getattr(self, "_socket_dir", None), None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        path, self._socket_file = getattr(self, "_socket_file", None), None
        if path is not None and not path.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __del__(self) -> None:
        self._close_listener()

    def run(self, command: Command) -> Reply | Packed:
        assert self.group is not None
        reply = run_command(self.group, command)
        if reply.infos or reply.values:
            # Ray pickles the reply after this returns, where a failure would lose the rows.
            try:
                cloudpickle.dumps((reply.infos, reply.values))
            except Exception as exc:
                reply = Reply(
                    env_ids=reply.env_ids,
                    failures=(*reply.failures, unpicklable(reply, exc)),
                    restarts=reply.restarts,
                )
        if not isinstance(command, EnvCommand):
            return reply
        rows = pack(self.batch, self.options.observation_space, reply, results=True)
        # A reply with more to say than rows and infos travels whole (failures, restarts, the
        # envs whose rows the pool keeps: what the process backend's wire sends whole too).
        if rows is None or beyond_infos(reply):
            reply.rows = rows
            return reply
        assert rows.rewards is not None and rows.terminations is not None
        assert rows.truncations is not None
        # The common case travels as a tuple: Ray pickles it faster than the dataclasses.
        return (
            rows.env_ids,
            rows.observations,
            rows.rewards,
            rows.terminations,
            rows.truncations,
            reply.infos,
        )

    def run_chunked(self, command: Command, chunks: int) -> tuple[bytes, ...]:
        """:meth:`run`, its result pickled and cut in ``chunks`` pieces for Ray to return.

        Ray returns a result under 100 KiB inline, in the reply to the call, and a larger one
        through its object store, which costs a round trip through the raylet on each side
        (about 40% of the time of a step of 8 Pong envs over 2 actors, on 2 cores here). The
        observations of a few images are larger: in pieces under that size, they travel inline.
        """
        data = cloudpickle.dumps(self.run(command), protocol=5)
        size = -(-len(data) // chunks)
        return tuple(data[k * size : (k + 1) * size] for k in range(chunks))


def unpack(result: Reply | Packed) -> Reply:
    """The :class:`Reply` an actor's :meth:`GroupActor.run` result stands for."""
    if isinstance(result, Reply):
        return result
    ids, observations, rewards, terminations, truncations, infos = result
    rows = Rows(ids, observations, rewards, terminations, truncations)
    return Reply(env_ids=tuple(ids.tolist()), infos=infos, rows=rows)


__all__ = ["GroupActor", "Packed", "unpack"]
