"""A node's agent: the Ray actor that runs one node's envs as a local process pool.

Ray places one agent on each node of the pool (pinned there), and it starts the node's worker
processes as a :class:`~envfleet.backends.contract.base.LocalPool`, the process backend's own
(:mod:`envfleet.backends.local.process`: shared memory, the same worker loop and stepping
loop; :mod:`envfleet.backends.local.shared_weights`: each version of a rollout's weights
written once into the node's shared memory, not down each worker's pipe), holding the pool's
*global* env indices, seeds and restart counts, so trajectories are those of one machine. It
then serves the pool over one
authenticated TCP connection (:meth:`NodeAgent.serve`: the loop of
:mod:`envfleet.backends.nodes.server`, the messages of :mod:`envfleet.backends.nodes.wire`): a
round of commands in, the local replies and rows of the whole node out, one message each way.
The pool's side is :mod:`envfleet.backends.nodes.transport`.

What ``multiprocessing`` keeps in files for the agent (its fork server's socket) goes in a
directory of the agent's own, ``envfleet-agent-<pid>-*`` in the node's temp dir: the agent
removes it when it closes; one that was killed (``ray.kill`` runs no exit handler) leaves it to
:func:`remove_dead_agents_dirs`, which the next agent on that node runs as it starts, and the
pool as it closes once its agents on its own machine are gone.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile

import numpy as np
import ray

from envfleet.affinity import usable_cpus
from envfleet.backends.contract.base import LocalPool
from envfleet.backends.contract.connections import accept_pool
from envfleet.backends.local import worker_process
from envfleet.backends.local.shared_weights import open_local_pool
from envfleet.backends.nodes import raw_rows
from envfleet.backends.nodes.compression import Codec, codec
from envfleet.backends.nodes.options import DEFAULT_CONTEXT, NodeOptions
from envfleet.backends.nodes.placement import alive_nodes, node_cpus
from envfleet.backends.nodes.server import NodeServer
from envfleet.backends.nodes.wire import Portable, portable
from envfleet.backends.ray.ended import alive
from envfleet.errors import EnvError
from envfleet.info_columns import Columns

AGENT_DIR_PREFIX = "envfleet-agent-"
"""How an agent's own temp directory is named: the prefix, its process id, ``-``, random."""


def remove_dead_agents_dirs(temp: str | None = None) -> None:
    """Remove the temp directories (in ``temp``, else this machine's temp dir) of agents whose
    process has ended."""
    pattern = os.path.join(temp or tempfile.gettempdir(), f"{AGENT_DIR_PREFIX}*-*")
    for path in glob.glob(pattern):
        pid = os.path.basename(path)[len(AGENT_DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):  # a zombie's is removed: it has exited
            shutil.rmtree(path, ignore_errors=True)


def node_cores(node: str) -> int:
    """The cores the agent of ``node`` (a Ray node id) may count on: the CPUs Ray gives that
    node, where it knows them, and no more than this process may run on (at least 1)."""
    cpus = {str(n["NodeID"]): node_cpus(n) for n in alive_nodes()}.get(node)
    usable = len(usable_cpus())
    return usable if cpus is None else max(1, min(usable, int(cpus)))


def leave_rays_main_alone() -> None:
    """Have the worker processes started from here not import this process's main script.

    An agent runs in a Ray worker process, whose main module is Ray's ``default_worker.py``. A
    process that ``multiprocessing`` starts with a fork server (or spawns) imports its parent's
    main script first (CPython 3.11's fork server does not preload it for them), so every one
    of the node's workers imported Ray (~0.4 s of CPU each here) though it runs envfleet's
    worker loop only, its code and envs unpickled. With no file to its name, the main module is
    left alone (as for an interactive session); Ray's worker reads that name only as a
    driver.
    """
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__spec__", None) is None:
        main.__dict__.pop("__file__", None)


def preload_worker_loop(context: str | None) -> None:
    """Have the fork server (``context``, the agent's default) import the workers' loop once,
    before it forks any: each worker then starts with envfleet, numpy and Gymnasium imported
    (a node pool of 2 nodes x 2 workers started in 1.2-1.7 s here instead of 1.7-2.1)."""
    if (context or DEFAULT_CONTEXT) == "forkserver":
        multiprocessing.set_forkserver_preload([worker_process.__name__])


class NodeAgent:
    """One node's envs in a local process pool, served to the pool over one connection."""

    def __init__(
        self,
        options: NodeOptions,
        restarts: dict[int, int],
        rows: list[np.ndarray] | None = None,
    ) -> None:
        self.options = options
        self.restarts = restarts
        self.rows = rows  # a replacement's: its envs' rows as the pool holds them
        self.local: LocalPool | None = None
        self._listener: socket.socket | None = None
        self._authkey = b""
        self._codec: Codec | None = None
        self._columns: list[Columns] = []  # infos its workers sent as columns, not yet sent on
        self._temp: str | None = None  # its own temp dir: multiprocessing's files

    def start(self, authkey: bytes) -> tuple[Portable | None, str, str, int, int]:
        """Start the node's workers and a listening socket on this node's address; return
        ``(error or None, node id, address, port, pid)``."""
        node = str(ray.get_runtime_context().get_node_id())
        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        try:
            self._codec = codec(getattr(self.options.backend_options, "compress", None))
        except ImportError as exc:  # lz4 on the pool's machine, not on this node
            return ("missing", f"node {node} ({host}): {exc}"), node, host, 0, os.getpid()
        remove_dead_agents_dirs()  # of agents killed on this node before
        leave_rays_main_alone()  # its workers, started below and on restarts, import no Ray
        preload_worker_loop(self.options.context)
        self._temp = tempfile.mkdtemp(prefix=f"{AGENT_DIR_PREFIX}{os.getpid()}-")
        # multiprocessing's own temp dir for this process (where its fork server's socket
        # goes), which it would otherwise make as pymp-* and remove only at exit.
        multiprocessing.current_process()._config["tempdir"] = self._temp  # type: ignore[attr-defined]
        try:
            # The cores its wait may count on are the node's, as Ray has them (the nodes of a
            # cluster on one machine share its cores): the process backend's wait spins for the
            # last replies while fewer workers owe one than there are cores, which takes a core
            # from the node's workers when it has none to spare.
            self.local = open_local_pool(self.options, self._columns.append, node_cores(node))
            # A replacement agent: its envs start restarted (flagged, reseeded by their count).
            for worker, ids in enumerate(self.options.assignment):
                counts = {i: self.restarts[i] for i in ids if i in self.restarts}
                if counts:
                    self.local.restart(worker, counts)
            if self.rows is not None:  # where they stand: a restarted env's latest stands
                envs = [i for block in self.options.assignment for i in block]
                sel = raw_rows.selection(np.array(envs, dtype=np.intp))
                fields = raw_rows.row_fields(self.local.batch)
                for field, rows in zip(fields, self.rows, strict=True):
                    field[sel] = rows
        except EnvError as exc:
            return portable(exc), node, host, 0, os.getpid()
        self._authkey = authkey
        self._listener = socket.create_server((host, 0), backlog=8)
        port = int(self._listener.getsockname()[1])
        return None, node, host, port, os.getpid()

    def serve(self) -> None:
        """Serve the pool until it closes the agent or goes away; then close the envs."""
        assert self._listener is not None and self.local is not None
        try:
            conn = accept_pool(self._listener, self._authkey)
        finally:
            self._listener.close()
            self._listener = None
        sock = socket.socket(fileno=conn.fileno())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.detach()
        try:
            with conn:
                spaces = (self.options.observation_space, self.options.action_space)
                workers = len(self.options.assignment)
                NodeServer(self.local, conn, workers, self._codec, self._columns, spaces).run()
        finally:
            self.local.close(5.0)
            self.remove_temp()

    def remove_temp(self) -> None:
        """Remove the agent's temp directory (its workers are gone: nothing needs it)."""
        temp, self._temp = self._temp, None
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


__all__ = [
    "AGENT_DIR_PREFIX",
    "NodeAgent",
    "leave_rays_main_alone",
    "node_cores",
    "preload_worker_loop",
    "remove_dead_agents_dirs",
]
