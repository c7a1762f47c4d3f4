"""The backend contract: a transport moves commands out and delivers envs back.

It knows nothing of autoreset, episodes or validation (that is the pool's and the group's job);
it starts the workers, hands each command to the right group, reports replies as they come and
turns a worker that disappears into a :class:`WorkerLost` reply instead of a hang.

**The transport owns delivery.** Once :meth:`Transport.wait` returns the reply to a
:class:`~envfleet.protocol.EnvCommand`, the rows of its envs (observations, rewards,
termination and truncation flags) are in :attr:`Transport.batch` and the reply carries only
what the pool still needs (infos, failures, restarts). How they got there is the transport's
business: written in place by a worker over shared memory (process, thread, serial, Ray on this
machine), or shipped back pickled (:class:`~envfleet.protocol.Rows` of a remote Ray actor, or
``Reply.observations`` of a space that shared memory cannot hold) and written by the
transport's pool side with :func:`deliver`.

Each backend is declared once in :data:`KINDS`: the module that implements it (imported only
when a pool is made: Ray is an optional extra) and the options it honours
(:class:`Capabilities`), which :func:`envfleet.make` asks instead of naming backends.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.affinity import Affinity
from envfleet.buffers import Batch, put
from envfleet.errors import OnError
from envfleet.protocol import Command, Reply
from envfleet.spec import EnvSpec

DEFAULT_START_TIMEOUT = 120.0
"""Seconds a worker may take to build its envs (at ``make()`` or a restart) by default."""


class Backend(enum.Enum):
    """Where the envs run."""

    SERIAL = "serial"
    THREAD = "thread"
    PROCESS = "process"
    RAY = "ray"


@dataclass(frozen=True)
class WorkerLost:
    """A worker exited or was killed; its in-flight commands will never be answered."""

    exitcode: int | None
    reason: str


@dataclass(frozen=True)
class RayOptions:
    """The ray backend's own options (``make(address=..., ray_init_kwargs=..., ...)``)."""

    address: str | None = None
    """``None``: the Ray this process is connected to, else a private local one."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``ray.init``."""
    worker_resources: dict[str, Any] = field(default_factory=dict)
    """``.options()`` of each actor."""
    shared_memory: bool = True
    """Whether actors on this machine share the batch memory and take commands on a socket."""
    nodes: str | tuple[str, ...] | None = None
    """``None``: one actor per worker; ``"auto"`` or Ray node ids: one sub-pool per node
    (:mod:`envfleet.backends.nodes`)."""


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
    ray: RayOptions | None = None  # the ray backend's own options
    start_timeout: float = DEFAULT_START_TIMEOUT  # seconds a worker may take to build its envs

    @property
    def num_envs(self) -> int:
        return sum(len(ids) for ids in self.assignment)


class Transport(Protocol):
    """What every backend implements."""

    batch: Batch
    """The pool-side view of the batch arrays the groups fill."""

    def submit(self, worker: int, command: Command) -> None:
        """Hand ``command`` to ``worker``; its reply comes back through :meth:`wait`.

        A command that the transport must serialise was serialised by :meth:`prepare` first
        (when the transport has one), so ``submit`` itself does not fail on the caller's data.
        """

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        """Replies that are in, in order per worker; block up to ``timeout`` for at least one.

        The envs of each reply to a step or reset are delivered: their rows are in
        :attr:`batch` (see the module docstring).

        ``None`` stands for a reply with nothing to report (the command simply succeeded).
        ``want`` is a hint: the pool will not act before that many replies are in (a transport
        may wait for them before waking it; it never exceeds the commands pending).
        """

    def kill(self, worker: int) -> None:
        """Kill a hung worker at once; :meth:`wait` then reports it lost."""

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        """Replace a lost worker by a fresh one whose envs all start restarted."""

    def close(self, timeout: float) -> None:
        """Stop every worker and free every resource; idempotent."""


@dataclass(frozen=True)
class Capabilities:
    """The options of :func:`envfleet.make` a backend honours (the others are refused)."""

    step_timeout: bool = False
    """Can it stop a worker that hangs (its envs run outside the caller's process)?"""
    threads_per_worker: bool = False
    """Can one worker step its envs on several threads?"""
    cpu_affinity: bool = False
    """Has it workers to pin?"""
    local_cpus: bool = True
    """Do its workers run on this machine (so ``cpu_affinity`` names this machine's CPUs)?"""
    worker_memory_limit: bool = False
    """Can it measure and replace a worker that uses too much memory?"""
    start_timeout: bool = False
    """Does it bound the time a worker takes to build its envs?"""
    one_worker: bool = False
    """Does it run every env in one worker whatever ``num_workers`` says?"""
    worker_per_env: bool = False
    """Is its default one worker per env (threads, for envs that wait) rather than per CPU?"""
    options: type | None = None
    """Its own options dataclass (:class:`RayOptions`), or ``None``."""


@dataclass(frozen=True)
class TransportKind:
    """A backend: where its transport lives and what it can do."""

    backend: Backend
    module: str
    capabilities: Capabilities


KINDS = {
    kind.backend: kind
    for kind in (
        TransportKind(Backend.SERIAL, "envfleet.backends.serial", Capabilities(one_worker=True)),
        TransportKind(
            Backend.THREAD,
            "envfleet.backends.thread",
            Capabilities(cpu_affinity=True, start_timeout=True, worker_per_env=True),
        ),
        TransportKind(
            Backend.PROCESS,
            "envfleet.backends.process",
            Capabilities(
                step_timeout=True,
                threads_per_worker=True,
                cpu_affinity=True,
                worker_memory_limit=True,
                start_timeout=True,
            ),
        ),
        TransportKind(
            Backend.RAY,
            "envfleet.backends.ray",
            Capabilities(
                step_timeout=True,
                threads_per_worker=True,
                cpu_affinity=True,
                local_cpus=False,
                worker_memory_limit=True,
                start_timeout=True,
                options=RayOptions,
            ),
        ),
    )
}
"""Every backend, by :class:`Backend`; readable without importing any backend's module."""


def capable(option: str) -> list[Backend]:
    """The backends whose :class:`Capabilities` say yes to ``option``, in :class:`Backend`
    order."""
    return [b for b in Backend if getattr(KINDS[b].capabilities, option)]


def deliver(batch: Batch, observation_space: gymnasium.Space[Any], reply: Reply) -> Reply:
    """Write what ``reply`` shipped back (rows, pickled observations) into ``batch``.

    For a transport's pool side, before its ``wait`` returns the reply; envs that failed are
    skipped (their rows stay as they were). Returns ``reply`` (for one-line call sites).
    """
    rows = reply.rows
    if rows is not None:
        ids = rows.env_ids
        if isinstance(batch.observations, list):
            for k, i in enumerate(ids.tolist()):
                batch.observations[i] = rows.observations[k]
        else:
            put(observation_space, batch.observations, ids, rows.observations)
        batch.rewards[ids] = rows.rewards
        batch.terminations[ids] = rows.terminations
        batch.truncations[ids] = rows.truncations
        reply.rows = None
    if reply.observations:
        failed = {f.env_index for f in reply.failures}
        for i, obs in reply.observations.items():
            if i not in failed:
                batch.observations[i] = obs
        reply.observations = None
    return reply


def open_transport(backend: Backend, options: TransportOptions) -> Transport:
    """Start the transport of ``backend`` (imported lazily: Ray is an optional extra)."""
    try:
        module = importlib.import_module(KINDS[backend].module)
    except ImportError as exc:
        if backend is Backend.RAY and exc.name == "ray":
            raise ImportError(
                "backend='ray' needs Ray: pip install 'envfleet[ray]'", name="ray"
            ) from exc
        raise
    transport: Transport = module.open_transport(options)
    return transport
