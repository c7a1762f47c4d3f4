"""What runs inside a worker, whatever the transport: build its group, serve its commands.

Every backend (serial, thread, process, ray) starts its groups and answers commands through
these two functions, so a failure at start-up or while serving looks the same everywhere.

Dependencies point down: the backends import this module, never the reverse. What a worker
needs from a transport's options is spelled out here as :class:`WorkerOptions`, a protocol
that ``backends.base.TransportOptions`` satisfies without naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import gymnasium
from gymnasium.vector import AutoresetMode

from envfleet.affinity import Affinity, pin_worker
from envfleet.buffers import Batch
from envfleet.errors import OnError, Phase
from envfleet.group import EnvGroup, GroupStartError
from envfleet.guards import env_errors
from envfleet.hosted import HostedGroup
from envfleet.protocol import Command, EnvFailure, Group, Reply, Sample
from envfleet.rollout_loop import sample
from envfleet.spec import EnvSpec
from envfleet.threads import ThreadedGroup, split_ids


class WorkerOptions(Protocol):
    """What a worker reads from its pool's options to build its group (read-only)."""

    @property
    def spec(self) -> EnvSpec: ...
    @property
    def assignment(self) -> Sequence[tuple[int, ...]]: ...
    @property
    def observation_space(self) -> gymnasium.Space[Any]: ...
    @property
    def action_space(self) -> gymnasium.Space[Any]: ...
    @property
    def autoreset_mode(self) -> AutoresetMode: ...
    @property
    def on_error(self) -> OnError: ...
    @property
    def seed_base(self) -> int | None: ...
    @property
    def threads_per_worker(self) -> int: ...
    @property
    def cpu_affinity(self) -> Affinity | None: ...


def build_group(
    options: WorkerOptions,
    env_ids: Sequence[int],
    batch: Batch,
    *,
    restarts: dict[int, int] | None = None,
    rebuild_timeout: float | None = None,
    rebuild_thread_timeout: float | None = None,
) -> EnvGroup | ThreadedGroup | HostedGroup:
    """The group a worker runs: one :class:`EnvGroup`, several on threads, or the hosted
    VectorEnvs of its blocks (:class:`~envfleet.hosted.HostedGroup`).

    Runs in the worker (its thread, process or actor): first pins it to its CPUs if the pool
    was made with ``cpu_affinity``, so its envs are built and stepped there, and threads it
    starts for ``threads_per_worker`` inherit them.
    """
    if options.cpu_affinity is not None:
        pin_worker(options.cpu_affinity, _worker_index(options, env_ids))
    recipe = getattr(options.spec, "recipe", None)
    if recipe is not None:  # a hosted VectorEnv for each block of envs
        return HostedGroup(
            recipe,
            env_ids,
            batch,
            options.autoreset_mode,
            options.observation_space,
            options.action_space,
            on_error=options.on_error,
            seed_base=options.seed_base,
            restarts=restarts,
            restarted=bool(restarts),
        )

    def group(ids: Sequence[int]) -> EnvGroup:
        return EnvGroup(
            options.spec,
            ids,
            batch,
            options.autoreset_mode,
            options.observation_space,
            options.action_space,
            on_error=options.on_error,
            seed_base=options.seed_base,
            restarts=restarts,
            restarted=bool(restarts),
            rebuild_timeout=rebuild_timeout,
            rebuild_thread_timeout=rebuild_thread_timeout,
        )

    if options.threads_per_worker <= 1 or len(env_ids) <= 1:
        return group(env_ids)
    groups: list[EnvGroup] = []
    try:
        for block in split_ids(env_ids, options.threads_per_worker):
            groups.append(group(block))
    except BaseException:
        for built in groups:
            built.close()
        raise
    return ThreadedGroup(groups)


def start_group(
    options: WorkerOptions,
    env_ids: Sequence[int],
    batch: Batch,
    *,
    restarts: dict[int, int] | None = None,
    rebuild_timeout: float | None = None,
    rebuild_thread_timeout: float | None = None,
) -> tuple[Group | None, Reply]:
    """Build a worker's group; the reply tells the pool it started or why it could not.

    ``rebuild_timeout``: only in a worker process of its own (see :class:`EnvGroup`).
    """
    try:
        group = build_group(
            options,
            env_ids,
            batch,
            restarts=restarts,
            rebuild_timeout=rebuild_timeout,
            rebuild_thread_timeout=rebuild_thread_timeout,
        )
    except GroupStartError as exc:
        return None, Reply(failures=(exc.failure,))
    except env_errors() as exc:
        return None, Reply(failures=(EnvFailure.capture(None, Phase.MAKE, exc),))
    return group, Reply()


def _worker_index(options: WorkerOptions, env_ids: Sequence[int]) -> int:
    """Which worker holds ``env_ids`` (workers hold disjoint blocks of env ids)."""
    first = env_ids[0]
    for worker, ids in enumerate(options.assignment):
        if first in ids:
            return worker
    raise ValueError(f"env {first} is not in the pool's assignment")


def run_command(group: Group, command: Command) -> Reply:
    """Run one command on ``group``: a rollout (:class:`~envfleet.protocol.Sample`) through its
    loop, :func:`envfleet.rollout_loop.sample`; any other through the group method it names."""
    if isinstance(command, Sample):
        return sample(group, command)
    return command.run(group)


def serve(group: Group, command: Command) -> Reply:
    """Run one command; anything it raises (beyond one env's failure) becomes a failure reply."""
    try:
        return run_command(group, command)
    except env_errors() as exc:
        return Reply(failures=(EnvFailure.capture(None, Phase.STEP, exc),))


__all__ = ["WorkerOptions", "build_group", "run_command", "serve", "start_group"]
