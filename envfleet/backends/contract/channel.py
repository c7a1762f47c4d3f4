"""A worker's side of a connection to the pool: receive commands, serve them, reply.

Two loops, one per wire; results land in shared memory and the reply says only what the pool
cannot read there (:mod:`~envfleet.backends.contract.replies`):

- :func:`serve_pipes` (the process backend): raw bytes over two pipes, framed as
  :mod:`~envfleet.backends.contract.framing` says. A step that reports nothing costs one byte
  each way and no pickling.
- :func:`serve_connection` (the Ray backend's same-machine actors): a ``multiprocessing``
  connection over a Unix socket (:mod:`~envfleet.backends.contract.connections`), one pickled
  message each way (a reply that carries nothing but infos of plain scalars: their columns
  alone).
"""

from __future__ import annotations

import os
import pickle
import select
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from envfleet.backends.contract.framing import (
    FRAME_BYTES,
    LENGTH,
    PLAIN_BYTES,
    encode_reply,
    read_exact,
    write_all,
)
from envfleet.backends.contract.landing import widen
from envfleet.backends.contract.replies import as_columns, plain, undecodable, unpicklable
from envfleet.info_columns import Columns
from envfleet.protocol import Close, Command, Group, Reply
from envfleet.worker import serve

__all__ = ["serve_connection", "serve_pipes", "spin"]


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
            data = conn.recv_bytes()
        except (EOFError, OSError):
            group.close()
            return
        try:
            command: Command = pickle.loads(data)
        except Exception as exc:
            conn.send(undecodable(exc))
            continue
        reply = serve(group, command)
        message: Reply | Columns | None = None if plain(reply) else as_columns(reply) or reply
        try:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # an info or call result that cannot be pickled
                conn.send(Reply(env_ids=reply.env_ids, failures=(unpicklable(reply, exc),)))
        except (BrokenPipeError, ConnectionResetError):
            group.close()
            return
        if isinstance(command, Close):
            return


def serve_pipes(
    group: Group,
    command_fd: int,
    reply_fd: int,
    spin_seconds: float = 0.0,
    after: Callable[[], None] | None = None,
) -> None:
    """Serve the pool's commands read from ``command_fd`` until it sends :class:`Close` or goes
    away (EOF: then close the envs), writing each reply to ``reply_fd``; ``spin_seconds``: how
    long to poll for the next command before blocking in the kernel; ``after``: called after
    each command, before its reply goes (the spare rows' copy,
    :mod:`~envfleet.backends.contract.spares`).

    The loop a worker runs every step: a repeated command and a plain reply cost one
    ``read`` and one ``write`` of a byte, and nothing else but the command itself. The reply
    pipe is widened (:func:`~envfleet.backends.contract.landing.widen`) before the first reply
    that carries large arrays.
    """
    command: Command | None = None
    ready = _readable(command_fd) if spin_seconds > 0 else None
    read, write = os.read, os.write
    widened = False
    while True:
        try:
            if ready is not None:
                spin(ready, spin_seconds)
            tag = read(command_fd, 1)
            if tag == FRAME_BYTES:
                (size,) = LENGTH.unpack(read_exact(command_fd, LENGTH.size))
                body = read_exact(command_fd, size)
                try:
                    command = pickle.loads(body)
                except Exception as exc:
                    command = None  # nothing to repeat
                    write_all(reply_fd, encode_reply(undecodable(exc)))
                    continue
            elif not tag or command is None:
                raise EOFError  # the pool is gone; or a repeat with nothing to repeat
        except (EOFError, OSError):
            group.close()
            return
        reply = serve(group, command)
        if after is not None:
            after()
        try:
            if plain(reply):  # the hot path: one byte, written whole (a blocking pipe)
                write(reply_fd, PLAIN_BYTES)
            else:
                encoded = encode_reply(reply)
                if isinstance(encoded, list) and not widened:
                    widened = widen(reply_fd)
                write_all(reply_fd, encoded)
        except OSError:  # the pool is gone
            group.close()
            return
        if isinstance(command, Close):
            return


def _readable(fd: int) -> Callable[[], bool]:
    """Whether ``fd`` has something to read, asked without blocking."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return lambda: bool(poller.poll(0))
