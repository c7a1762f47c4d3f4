"""The Ray backend's handle on one worker's actor, the framing of commands to an actor on this
machine, and how a pool's actors end.

An actor on the pool's machine takes commands over a Unix socket (framed as
``multiprocessing.connection`` frames them); any other through Ray calls. Ending them asks each
to close its envs, waits up to the close timeout, kills them through Ray, and then sees that
those on this machine have really ended: ``ray.kill`` only asks Ray, whose daemons may take
seconds to act on a busy machine, and ``close()`` returns once nothing of the pool runs here.
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil
import ray

from envfleet.backends.contract.outbox import Outbox
from envfleet.backends.ray.ended import bury
from envfleet.protocol import Close, Command


@dataclass(eq=False)
class ActorSlot:
    """One worker's actor, and how the pool talks to it."""

    handle: Any = None
    node: str = ""  # the Ray node it runs on
    pid: int | None = None  # its process
    # The same, when it runs on the pool's machine: taken when it started, so that a pid
    # another process has taken since is never mistaken for it (psutil checks).
    process: psutil.Process | None = None
    # Ray calls in flight: (result refs, command), oldest first; the refs are the pieces of one
    # result (one ref unless the result travels in pieces).
    refs: deque[tuple[list[Any], Command]] = field(default_factory=deque)
    # On this machine: its socket, the call that serves it, the replies it owes on it, and the
    # bytes of commands the socket had no room for yet (written as it drains, within wait(): a
    # large command to an actor hung in a step cannot hold the pool up past step_timeout).
    conn: Connection | None = None
    sock: socket.socket | None = None  # the same socket, to send without blocking
    serving: Any = None
    owed: int = 0
    outbox: Outbox | None = None

    def runs_on(self, node: str | None) -> bool:
        """Whether its process is known and on ``node`` (whose processes this one can read)."""
        return self.pid is not None and node is not None and self.node == node


def message(data: bytes) -> bytes:
    """``data`` framed as ``multiprocessing.connection.Connection.send_bytes`` frames it (the
    actor reads it with ``recv``)."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(data)) + data
    return struct.pack("!i", len(data)) + data


def close_actors(slots: list[ActorSlot], close: bytes, timeout: float) -> None:
    """Ask each actor to close its envs (``close``: the pickled :class:`Close` for those on a
    socket), wait up to ``timeout``, kill them all, then wait up to ``timeout`` again for the
    processes of those on this machine (:attr:`ActorSlot.process`) and end those still there."""
    closing = []
    for slot in slots:
        if slot.outbox is not None:
            slot.outbox.flush()
            # Without blocking: an actor that cannot take it is killed below all the same.
            slot.outbox.send(message(close))
            continue
        try:
            closing.append(slot.handle.run.remote(Close()))
        except Exception:
            pass
    # A socket actor's serve call returns once it has closed its envs (or it died).
    closing += [slot.serving for slot in slots if slot.conn is not None]
    local = [slot.process for slot in slots if slot.process is not None]
    try:
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=timeout)
    except Exception:
        pass  # a dead actor or node: killed below all the same
    finally:  # a Ctrl-C in the wait too
        for slot in slots:
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass
        bury(local, timeout)


__all__ = ["ActorSlot", "close_actors", "message"]
