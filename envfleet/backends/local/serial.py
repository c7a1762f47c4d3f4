"""The serial backend: the reference semantics, every group stepped in the caller's thread."""

from __future__ import annotations

import sys
import threading
from collections import deque

from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    TransportOptions,
    WorkerLost,
)
from envfleet.buffers import Batch
from envfleet.protocol import Command, EnvFailure, Group, Reply
from envfleet.worker import serve, start_group


class SerialTransport(BaseTransport, BaseWorkers):
    """Runs the commands submitted when the pool waits, in order, in the caller's thread.

    A command interrupted by the caller's Ctrl-C (``KeyboardInterrupt`` in an env, on the
    caller's thread) is answered by a failure of the whole command before the interrupt goes
    on, so that the pool never waits for a reply that cannot come; the commands after it run at
    the next ``wait``.
    """

    def __init__(self, options: TransportOptions) -> None:
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self.groups: list[Group] = []
        self._replies: deque[tuple[int, Reply | WorkerLost | None]] = deque()
        self._commands: deque[tuple[int, Command]] = deque()
        for worker, ids in enumerate(options.assignment):
            group, started = start_group(options, ids, self.batch)
            if group is None:
                self.close(5.0)
                raise started.failures[0].to_error(worker, options.spec.name)
            self.groups.append(group)

    def submit(self, worker: int, command: Command) -> None:
        self._commands.append((worker, command))

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        commands = self._commands
        while commands:
            worker, command = commands.popleft()
            try:
                reply = serve(self.groups[worker], command)
            except BaseException as exc:  # Ctrl-C in an env: its state is unknown
                failure = EnvFailure.capture(None, command.phase, exc)
                self._replies.append((worker, Reply(failures=(failure,))))
                raise
            self._replies.append((worker, reply))
        replies = list(self._replies)
        self._replies.clear()
        return replies

    def kill(self, worker: int) -> None:
        raise NotImplementedError("the serial backend runs envs in the caller's thread")

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        raise NotImplementedError("a serial group never dies without its caller")

    def close(self, timeout: float) -> None:
        """Close the envs on a daemon thread, waiting at most ``timeout`` seconds for it.

        The envs run in the caller's thread, which must not be held by an env whose ``close``
        hangs: past the timeout that thread is abandoned (it cannot be stopped) and ``close``
        returns.
        """
        groups, self.groups = list(self.groups), []
        self._commands.clear()
        if not groups:
            return

        def close_all() -> None:
            for group in groups:
                try:
                    group.close()
                except BaseException:  # close reports, never raises
                    pass

        if sys.is_finalizing():
            # A pool never closed, collected at interpreter exit: a thread started now never
            # runs (Python 3.11's start() then waits for it for ever), so close here, unbounded.
            close_all()
            return
        closer = threading.Thread(target=close_all, name="envfleet-serial-close", daemon=True)
        try:
            closer.start()
        except RuntimeError:  # no new threads at interpreter shutdown: close here, unbounded
            close_all()
            return
        closer.join(max(0.0, timeout))


def open_transport(options: TransportOptions) -> SerialTransport:
    return SerialTransport(options)


__all__ = ["SerialTransport", "open_transport"]
