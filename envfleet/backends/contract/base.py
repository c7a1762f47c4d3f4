"""The backend contract: a transport moves commands out and delivers envs back.

It knows nothing of autoreset, episodes or validation (that is the pool's and the group's job);
it hands each command to the right group, reports replies as they come and turns a worker that
disappears into a :class:`WorkerLost` reply instead of a hang.

**The transport owns delivery.** Once :meth:`Transport.wait` returns the reply to a
:class:`~envfleet.protocol.EnvCommand`, the rows of its envs (observations, rewards,
termination and truncation flags) are in :attr:`Transport.batch` and the reply carries only
what the pool still needs (infos, failures, restarts). How they got there is the transport's
business: written in place by a worker over shared memory (process, thread, serial, Ray on this
machine), or shipped back as :class:`~envfleet.protocol.Rows` (a remote Ray actor; a space that
shared memory cannot hold) and written by the transport's pool side
(:mod:`envfleet.backends.contract.rows`).

The contract comes in two protocols, both called by the pool's dispatch alone:

- :class:`Transport`, the conversation: ``prepare``, ``submit``, ``submit_all``, ``wait``
  (the step path);
- :class:`Workers`, the workers' lifecycle: ``kill``, ``restart``, ``memory``, ``forked``,
  ``close`` (the workers start with the transport; one lost, or killed, is reported by
  :meth:`Transport.wait` as :class:`WorkerLost`). A transport names its workers as
  :attr:`Transport.workers`; in each family the transport is its own workers (its lifecycle
  works on the very connections its conversation uses) and :class:`BaseWorkers` says so.

What only some backends have are capabilities of their own, each a small protocol the dispatch
checks once, when it is made: :class:`HasSpares` (spare observation rows a sync step hands
out: the process backend), :class:`HasNodes` (what runs on each machine: node sub-pools),
:class:`SubmitsMany` (several commands in one message: node sub-pools) and
:class:`LandsParts` (a rollout's parts read straight into the pool's arrays: the process
backend, node sub-pools).
:class:`BaseTransport`
and :class:`BaseWorkers` give the optional methods their defaults; a backend subclasses both
and overrides what it does better. Which backends exist, and what each can do, is the
registry's (:mod:`envfleet.backends.contract.registry`).

:class:`LocalPool` is the other interface declared here: what a node's agent (the node
sub-pools, :mod:`envfleet.backends.nodes`) asks of the pool of worker processes it runs on its
node. The node family runs its node's workers through it alone, and the local family provides
one (:func:`envfleet.backends.local.shared_weights.open_local_pool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.affinity import Affinity
from envfleet.backends.contract.spares import Spares
from envfleet.buffers import Batch
from envfleet.errors import OnError
from envfleet.protocol import Command, Reply, Sample
from envfleet.rollout_loop import Sampled
from envfleet.spec import EnvSpec
from envfleet.stats import NodeStats

DEFAULT_START_TIMEOUT = 120.0
"""Seconds a worker may take to build its envs (at ``make()`` or a restart) by default."""


@dataclass(frozen=True)
class WorkerLost:
    """A worker exited or was killed; its in-flight commands will never be answered."""

    exitcode: int | None
    reason: str


@dataclass(frozen=True)
class TransportOptions:
    """Everything a transport needs to start its workers."""

    spec: EnvSpec
    assignment: Sequence[tuple[int, ...]]  # global env ids per worker
    observation_space: gymnasium.Space[Any]
    action_space: gymnasium.Space[Any]
    autoreset_mode: AutoresetMode
    context: str | None = None
    on_error: OnError = OnError.RAISE
    seed_base: int | None = None
    threads_per_worker: int = 1
    cpu_affinity: Affinity | None = None  # applied by each worker to itself (affinity.py)
    start_timeout: float = DEFAULT_START_TIMEOUT  # seconds a worker may take to build its envs
    step_timeout: float | None = None  # the pool's; bounds what a transport cannot hand off
    copy: bool = True  # the pool hands out copies of the observations (it may keep spares)
    backend_options: Any = None
    """The backend's own options: an instance of its registered options type, or ``None``."""

    @property
    def num_envs(self) -> int:
        return sum(len(ids) for ids in self.assignment)


Replies = list[tuple[int, Reply | WorkerLost | None]]
"""What :meth:`Transport.wait` returns: ``(worker, reply)`` pairs, in order per worker."""


class Workers(Protocol):
    """A transport's workers' lifecycle: what the pool's dispatch asks of them beyond the
    conversation. They are started when the transport is opened (a worker that cannot build
    its envs fails the opening); one that dies, or is killed, is reported by
    :meth:`Transport.wait` as :class:`WorkerLost`."""

    def kill(self, worker: int) -> None:
        """Kill a hung worker at once; :meth:`Transport.wait` then reports it lost."""

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        """Replace a lost worker by a fresh one whose envs all start restarted."""

    def memory(self, worker: int) -> int | None:
        """Bytes of memory ``worker`` uses (``worker_memory_limit``); ``None``: unknown.
        Default: ``None`` (a backend without worker processes of its own)."""

    def forked(self) -> None:
        """Called in a forked child that inherited the workers: they are the parent's, and
        must be let go of without being touched. Default: nothing."""

    def close(self, timeout: float) -> None:
        """Stop every worker and free every resource; idempotent."""


class Transport(Protocol):
    """The conversation with the workers: all the pool's dispatch calls on a step's path."""

    batch: Batch
    """The pool-side view of the batch arrays the groups fill."""

    @property
    def workers(self) -> Workers:
        """The workers' lifecycle (in each family, the transport itself)."""

    def prepare(self, worker: int, command: Command) -> None:
        """Serialise ``command`` for ``worker`` now, before the pool changes any state, so that
        a command that cannot travel fails with the pool as it was; :meth:`submit` then does
        not fail on the caller's data. Called before :meth:`submit` for every command but the
        whole-pool step (:meth:`submit_all`). Default: nothing to serialise."""

    def submit(self, worker: int, command: Command) -> None:
        """Hand ``command`` to ``worker``; its reply comes back through :meth:`wait`."""

    def submit_all(self, commands: Sequence[Command]) -> None:
        """Hand ``commands[w]`` to each worker ``w`` at once: the whole-pool step, sent only
        when every worker owes nothing. Default: :meth:`submit` each."""

    def wait(self, timeout: float | None, want: int = 1) -> Replies:
        """Replies that are in, in order per worker; block up to ``timeout`` for at least one.

        The envs of each reply to a step or reset are delivered: their rows are in
        :attr:`batch` (see the module docstring).

        ``None`` stands for a reply with nothing to report (the command simply succeeded).
        ``want`` is a hint: the pool will not act before that many replies are in (a transport
        may wait for them before waking it; it never exceeds the commands pending).
        """


@runtime_checkable
class HasSpares(Protocol):
    """A transport with spare observation rows the workers copy a sync step's rows into, for
    the pool to hand out instead of a copy of its own
    (:mod:`~envfleet.backends.contract.spares`; the process backend). Without it, or with
    ``spares`` ``None``, the pool copies. The pool arms one before a whole-pool step
    (:meth:`Transport.submit_all`); the transport spoils it when rows of that step reach the
    batch another way than a worker's plain reply (a worker lost or restarted, rows delivered
    from a reply)."""

    spares: Spares | None


@runtime_checkable
class HasNodes(Protocol):
    """A transport whose workers run on several machines (node sub-pools)."""

    def nodes(self) -> tuple[NodeStats, ...]:
        """Per machine, what it runs there (``pool.stats().nodes``, ``repr(pool)``). Without
        it: ``()`` (one machine)."""


@runtime_checkable
class SubmitsMany(Protocol):
    """A transport that sends several workers' commands in one message (node sub-pools: one
    per node)."""

    def submit_many(self, commands: Sequence[tuple[int, Command]]) -> None:
        """Hand each ``(worker, command)`` pair over, in order (a reset, a call, an async
        step: each prepared first). Without it: :meth:`Transport.submit` each."""


@runtime_checkable
class LandsParts(Protocol):
    """A transport that reads a rollout's parts straight into arrays the pool gives (the
    process backend from each worker's pipe, node sub-pools from a node's socket: into the
    rollout's columns, one copy per field). Without it, a part comes in arrays of its own,
    which the pool copies."""

    def land(self, worker: int, command: Sample, into: Sampled) -> None:
        """Read the recorded arrays (observations, actions, rewards, terminations,
        truncations) of the answer to ``command`` (sent to ``worker``) into ``into``'s, where
        that part fits them (its steps, dtypes and shapes); the reply's part then holds
        ``into``'s very arrays."""


class BaseTransport:
    """The defaults of :class:`Transport`'s optional methods; subclass it for a backend."""

    batch: Batch

    def prepare(self, worker: int, command: Command) -> None:
        pass  # nothing is serialised before submit

    def submit(self, worker: int, command: Command) -> None:
        raise NotImplementedError

    def submit_all(self, commands: Sequence[Command]) -> None:
        submit = self.submit
        for worker, command in enumerate(commands):
            submit(worker, command)

    def wait(self, timeout: float | None, want: int = 1) -> Replies:
        raise NotImplementedError


class BaseWorkers:
    """The defaults of :class:`Workers`' optional methods, for a transport that is its own
    workers: :attr:`workers` is the transport itself."""

    @property
    def workers(self) -> Workers:
        return self

    def kill(self, worker: int) -> None:
        raise NotImplementedError

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        raise NotImplementedError

    def memory(self, worker: int) -> int | None:
        return None  # no worker process of its own to measure

    def forked(self) -> None:
        pass  # nothing of the parent's to let go of

    def close(self, timeout: float) -> None:
        raise NotImplementedError


class LocalPool(Workers, Protocol):
    """A pool of worker processes on one machine, as a node's agent runs it for its node: its
    own :class:`Workers` (the agent kills, restarts, measures and closes them).

    What the agent asks of it beyond a :class:`Transport`'s submit and wait: to wait with a
    ``linger`` (hold a fast worker's reply that long at most for the others), to wait for one
    worker alone (:meth:`read_plain`) and to stop waiting when the agent's own connection speaks
    (:meth:`watch`). Its workers hold the pool's global env indices (rows of a batch as large as
    the whole pool's). One is opened by the local family's ``open_local_pool(options,
    info_columns, cores)``: infos the workers send as columns go, as they came, to
    ``info_columns``; ``cores`` are the cores its waits may count on.
    """

    batch: Batch

    def submit(self, worker: int, command: Command) -> None:
        """Hand ``command`` to ``worker``."""

    def submit_all(self, commands: Sequence[Command]) -> None:
        """Hand ``commands[w]`` to each worker ``w`` at once (a sync step)."""

    def wait(self, timeout: float | None, want: int = 1, linger: float | None = None) -> Replies:
        """Replies that are in, as :meth:`Transport.wait`; with ``linger``, at most that long
        after the first is in."""

    def watch(self, fd: int) -> None:
        """Have :meth:`wait` also end, with what is in, once ``fd`` is readable."""

    def read_plain(self, worker: int, timeout: float) -> Replies | None:
        """``worker``'s next reply, waited for up to ``timeout`` on its own: ``None`` when it
        is one plain reply (its infos, if any, gone to ``info_columns``), else what came, as
        :meth:`wait` gives it (none: nothing in time). An agent reads a sync step's replies so,
        in the workers' order."""


__all__ = [
    "DEFAULT_START_TIMEOUT",
    "BaseTransport",
    "BaseWorkers",
    "HasNodes",
    "HasSpares",
    "LandsParts",
    "LocalPool",
    "Replies",
    "SubmitsMany",
    "Transport",
    "TransportOptions",
    "WorkerLost",
    "Workers",
]
