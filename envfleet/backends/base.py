"""The backend contract: a transport only moves commands and replies.

It knows nothing of autoreset, episodes or validation (that is the pool's and the group's job);
it starts the workers, hands each command to the right group, reports replies as they come and
turns a worker that disappears into a :class:`WorkerLost` reply instead of a hang.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.affinity import Affinity
from envfleet.buffers import Batch
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
    ray: dict[str, Any] | None = None  # address, init_kwargs, worker_resources
    start_timeout: float = DEFAULT_START_TIMEOUT  # seconds a worker may take to build its envs

    @property
    def num_envs(self) -> int:
        return sum(len(ids) for ids in self.assignment)


class Transport(Protocol):
    """What every backend implements."""

    batch: Batch
    """The pool-side view of the batch arrays the groups fill."""

    shares_memory: bool
    """Whether the groups write :attr:`batch` directly (else results come back as rows)."""

    def submit(self, worker: int, command: Command) -> None:
        """Hand ``command`` to ``worker``; its reply comes back through :meth:`wait`.

        A command that the transport must serialise was serialised by :meth:`prepare` first
        (when the transport has one), so ``submit`` itself does not fail on the caller's data.
        """

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        """Replies that are in, in order per worker; block up to ``timeout`` for at least one.

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


_MODULES = {
    Backend.SERIAL: "envfleet.backends.serial",
    Backend.THREAD: "envfleet.backends.thread",
    Backend.PROCESS: "envfleet.backends.process",
    Backend.RAY: "envfleet.backends.ray",
}


def open_transport(backend: Backend, options: TransportOptions) -> Transport:
    """Start the transport of ``backend`` (imported lazily: Ray is an optional extra)."""
    try:
        module = importlib.import_module(_MODULES[backend])
    except ImportError as exc:
        if backend is Backend.RAY and exc.name == "ray":
            raise ImportError(
                "backend='ray' needs Ray: pip install 'envfleet[ray]'", name="ray"
            ) from exc
        raise
    transport: Transport = module.open_transport(options)
    return transport
