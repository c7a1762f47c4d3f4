"""A worker's side of a connection to the pool: receive commands, serve them, reply.

The process backend's workers and the Ray backend's same-machine actors run this one loop over
a ``multiprocessing`` connection (a pipe, or a Unix socket); results land in shared memory and
the reply says only what the pool cannot read there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from envfleet.errors import Phase
from envfleet.protocol import Close, Command, EnvFailure, Group, Reply
from envfleet.worker import plain, serve


def spin(ready: Callable[[], bool], seconds: float) -> bool:
    """Poll ``ready()`` for up to ``seconds`` without sleeping; True once it says so."""
    if seconds <= 0:
        return False
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if ready():
            return True
    return False


def serve_connection(group: Group, conn: Connection, spin_seconds: float = 0.0) -> None:
    """Serve the pool's commands until it sends :class:`Close` or goes away (then close envs)."""
    while True:
        try:
            spin(conn.poll, spin_seconds)
            command: Command = conn.recv()
        except (EOFError, OSError):
            group.close()
            return
        reply = serve(group, command)
        try:
            try:
                conn.send(None if plain(reply) else reply)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # an info or call result that cannot be pickled
                conn.send(Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),)))
        except (BrokenPipeError, ConnectionResetError):
            group.close()
            return
        if isinstance(command, Close):
            return


def unpicklable(reply: Reply, exc: Exception) -> EnvFailure:
    """The failure that replaces a reply that cannot be pickled (naming its first env)."""
    try:
        raise TypeError(f"the reply could not be pickled to send to the pool: {exc}") from exc
    except TypeError as error:
        env = reply.env_ids[0] if reply.env_ids else None
        return EnvFailure.capture(env, Phase.STEP, error)


class PickledCommands:
    """Commands pickled once each: the pool sends the same step-every-env commands every step."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Command, bytes]] = {}

    def dumps(self, command: Command) -> bytes:
        cached = self._cache.get(id(command))
        if cached is None or cached[0] is not command:
            if len(self._cache) > 256:
                self._cache.clear()
            cached = (command, bytes(ForkingPickler.dumps(command)))
            self._cache[id(command)] = cached
        return cached[1]
