"""The serial backend: the reference semantics, every group stepped in the caller's thread."""

from __future__ import annotations

from collections import deque

from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.buffers import Batch
from envfleet.group import EnvGroup, GroupStartError
from envfleet.protocol import Command, Reply


class SerialTransport:
    """Runs each command as soon as it is submitted; replies queue until ``wait``."""

    def __init__(self, options: TransportOptions) -> None:
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self.groups: list[EnvGroup] = []
        self._replies: deque[tuple[int, Reply | WorkerLost | None]] = deque()
        try:
            for ids in options.assignment:
                self.groups.append(
                    EnvGroup(
                        options.spec,
                        ids,
                        self.batch,
                        options.autoreset_mode,
                        options.observation_space,
                        options.action_space,
                        on_error=options.on_error,
                        seed_base=options.seed_base,
                    )
                )
        except GroupStartError as exc:
            self.close(0.0)
            raise exc.failure.to_error(len(self.groups), options.spec.name)  # noqa: B904

    shares_memory = True

    def submit(self, worker: int, command: Command) -> None:
        self._replies.append((worker, command.run(self.groups[worker])))

    def wait(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        replies = list(self._replies)
        self._replies.clear()
        return replies

    def kill(self, worker: int) -> None:
        raise NotImplementedError("the serial backend runs envs in the caller's thread")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        raise NotImplementedError("a serial group never dies without its caller")

    def close(self, timeout: float) -> None:
        for group in self.groups:
            group.close()
        self.groups.clear()


def open_transport(options: TransportOptions) -> SerialTransport:
    return SerialTransport(options)
