"""A backend from outside envfleet's own list, built on the contract alone: a loopback wire.

The envs run in the caller's thread, on a serial transport of their own ("the far side") whose
batch arrays are not the pool's: every command and every reply is pickled and unpickled on the
way, as over a real wire, and the far side's rows travel back as
:class:`~envfleet.protocol.Rows` that this transport delivers into the pool's batch. So it
exercises everything a new backend relies on (``prepare``, actions carried in the command,
rows shipped and delivered, ``kept`` observations, plain replies) with nothing but
:mod:`envfleet.backends`' public contract: a :class:`~envfleet.backends.Transport` (the
conversation) that is its own :class:`~envfleet.backends.Workers` (their lifecycle: closed,
never killed nor restarted), with none of the optional capabilities
(:class:`~envfleet.backends.HasSpares`, :class:`~envfleet.backends.HasNodes`,
:class:`~envfleet.backends.SubmitsMany`); ``tests/test_extra_backend.py`` registers it and runs
the equivalence and failure suites on it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle

from envfleet.backends import (
    BaseTransport,
    BaseWorkers,
    Capabilities,
    TransportKind,
    TransportOptions,
)
from envfleet.backends.contract.base import Replies
from envfleet.backends.contract.replies import plain, unpicklable
from envfleet.backends.contract.rows import deliver, pack
from envfleet.backends.local.serial import SerialTransport
from envfleet.buffers import Batch, is_array_space
from envfleet.protocol import Command, Reply, Step
from envfleet.row_access import make_reader

KIND = TransportKind("loopback", __name__, Capabilities())
"""How the tests register it: no capability beyond the defaults (no worker to kill)."""


class LoopbackTransport(BaseTransport, BaseWorkers):
    """Groups served by a serial transport on arrays of their own, over a pickling wire.

    The conversation (``prepare``, ``submit``, ``wait``; ``submit_all`` is
    :class:`BaseTransport`'s) and, as its own ``workers``, their lifecycle (``kill``,
    ``restart``, ``close``; ``memory`` and ``forked`` are :class:`BaseWorkers`').
    """

    def __init__(self, options: TransportOptions) -> None:
        self._space = options.observation_space
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self._read_action: Callable[[int], Any] | None = (
            make_reader(options.action_space, self.batch.actions)
            if is_array_space(options.action_space)
            else None
        )
        self._far = SerialTransport(options)  # its batch is its own, never the pool's
        self._wire: dict[int, tuple[Command, bytes]] = {}

    def _dumps(self, command: Command) -> bytes:
        cached = self._wire.get(id(command))
        if cached is None or cached[0] is not command:
            cached = self._wire[id(command)] = (command, cloudpickle.dumps(command))
        return cached[1]

    def prepare(self, worker: int, command: Command) -> None:
        self._dumps(command)  # what cannot travel fails here, before the pool changes

    def submit(self, worker: int, command: Command) -> None:
        if isinstance(command, Step) and command.actions is None and self._read_action:
            # The pool wrote the actions into its batch, which the far side does not see.
            read = self._read_action
            command = Step(command.env_ids, {i: read(i) for i in command.env_ids})
        self._far.submit(worker, pickle.loads(self._dumps(command)))

    def wait(self, timeout: float | None, want: int = 1) -> Replies:
        replies: Replies = []
        for worker, reply in self._far.wait(timeout, want):
            if isinstance(reply, Reply):
                reply.rows = pack(self._far.batch, self._space, reply, results=True)
                try:
                    data = cloudpickle.dumps(reply)
                except Exception as exc:  # an info or value that cannot travel
                    data = pickle.dumps(
                        Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),))
                    )
                reply = deliver(self.batch, self._space, pickle.loads(data))
                replies.append((worker, None if plain(reply) else reply))
            else:
                replies.append((worker, reply))
        return replies

    def kill(self, worker: int) -> None:
        raise NotImplementedError("the loopback backend runs envs in the caller's thread")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        raise NotImplementedError("a loopback group never dies without its caller")

    def close(self, timeout: float) -> None:
        self._wire.clear()
        self._far.close(timeout)


def open_transport(options: TransportOptions) -> LoopbackTransport:
    return LoopbackTransport(options)
