"""The messages between a pool and its node agents: one per node per command round.

::

    pool (driver)                                     node agent (one per node)
    ─────────────                                     ─────────────────────────
    R + action rows ─────── "the same round again" ─► write the rows into its batch, submit
    S + len + pickle[(worker, command)] + actions ──►   each command to its local worker
      (s + ... + frame: a rollout's large frame,
       a version's weights, once, after the pickle)
                                                      wait for the local replies (its pipes)
    rows into the batch arrays ◄──── P + rows ─────── every command answered, nothing to say
      (np.frombuffer + one slice   ◄─ I + columns + rows  nothing to say but infos of plain
       assignment per field;                          scalars (Atari's, MuJoCo's): columns
       columns into its InfoTable)   G + len + pickle[([(worker, reply)], columns)]
                                        + large buffers + rows
                                                      (dict infos, failures, a lost worker,
                                                      a rollout: its parts, their recorded
    rollout's columns ◄────── arrays' bytes ───────── arrays in a frame of their own after it)
    K + worker (2 bytes) ───────────────────────────► kill a hung local worker (reported lost)
    X + pickle((worker, restarts)) ─────────────────► rebuild one local worker; A + pickle(error)
    C ──────────────────────────────────────────────► close; A, then the agent's loop ends
    M ──────────────────────────────────────────────► its workers' resident memory:
      (worker_memory_limit)        ◄──── M + int64 bytes per local worker (-1: unknown)

``worker`` is the agent's own (local) worker index. Rows travel as the raw bytes of each field
(:mod:`envfleet.backends.nodes.raw_rows`: observation leaves, rewards, terminations,
truncations, in an order both sides compute from the same commands; a step's actions travel the
same way). Spaces that are not arrays (pickled path) carry their observations in the pickled
part instead. With ``compress=``, the rows of each image field
(:mod:`envfleet.backends.nodes.compression`) travel instead as one compressed block, its length
(8 bytes) first. Infos that the workers sent as columns
(:func:`~envfleet.info_columns.info_columns`: one record per env) travel as they came, those of one
layout joined (:func:`join_columns`), and go into the pool's
:class:`~envfleet.infos.InfoTable` with no Python per env; other infos are the replies' dicts.
In the general answer to a rollout, the parts' recorded arrays travel in the frame after it
(:mod:`envfleet.backends.contract.raw_parts`: read straight into the rollout's columns), and the
other buffers of 64 KB or more (final observations, large infos) after the pickle (pickle's
protocol 5, out of band), unpickled as views of the message: neither end copies them in or out
of the pickle.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envfleet import out_of_band as apart
from envfleet.errors import EnvError, EnvTimeoutError, WorkerDiedError
from envfleet.info_columns import Columns
from envfleet.protocol import Command, EnvFailure, Sample

REPEAT = b"R"
SUBMIT = b"S"
SUBMIT_APART = b"s"  # commands with a large frame (a version's weights) after the pickle
PLAIN = b"P"
INFOS = b"I"
GENERAL = b"G"
RESTART = b"X"
CLOSE = b"C"
KILL = b"K"
ACK = b"A"
MEMORY = b"M"
_LENGTH = struct.Struct("<Q")
_COUNT = struct.Struct("<H")


def plain_workers(workers: Sequence[int]) -> bytes:
    """Which local workers a plain answer answers (one command each, in this order)."""
    return _COUNT.pack(len(workers)) + np.asarray(workers, dtype=np.uint16).tobytes()


def read_plain_workers(data: Any) -> tuple[bytes, int]:
    """The workers part of a plain answer (as bytes, a cache key), and the offset after it."""
    (n,) = _COUNT.unpack_from(data, 1)
    end = 1 + _COUNT.size + 2 * n
    return bytes(data[1:end]), end


def join_columns(parts: Sequence[Columns]) -> list[Columns]:
    """The columns of an answer's replies, those of one layout joined in one (by env, in
    order: a node's envs are consecutive, so they usually land with one slice assignment)."""
    if len(parts) == 1:
        return list(parts)
    joined: dict[bytes, list[Columns]] = {}
    for part in sorted(parts, key=_first_env):
        joined.setdefault(part[1], []).append(part)
    return [
        (
            tuple(i for ids, _, _ in same for i in ids),
            layout,
            b"".join([data for _, _, data in same]),
        )
        for layout, same in joined.items()
    ]


def _first_env(columns: Columns) -> int:
    return columns[0][0]


def pickled(body: Any) -> bytes:
    """``body`` pickled, its length first."""
    blob = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(blob)) + blob


def read_pickled(data: Any, at: int) -> tuple[Any, int]:
    """What :func:`pickled` wrote at offset ``at``, and the offset after it."""
    (size,) = _LENGTH.unpack_from(data, at)
    start = at + _LENGTH.size
    return pickle.loads(memoryview(data)[start : start + size]), start + size  # no copy first


def memory(used: Sequence[int | None]) -> bytes:
    """An agent's answer to :data:`MEMORY`: the resident bytes of each of its workers."""
    return MEMORY + np.array([-1 if u is None else u for u in used], dtype=np.int64).tobytes()


def read_memory(data: Any) -> list[int | None]:
    """The bytes of each worker in an answer to :data:`MEMORY` (``None``: unknown)."""
    values = np.frombuffer(data, np.int64, offset=1).tolist()
    return [None if v < 0 else int(v) for v in values]


def header(tag: bytes, body: Any) -> bytes:
    """``tag``, then ``body`` pickled with its length first."""
    return tag + pickled(body)


def header_apart(tag: bytes, body: Any) -> list[bytes]:
    """:func:`header`'s bytes in two parts, for one ``writev``: the pickle is not copied behind
    its length (a round's weights are megabytes)."""
    blob = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    return [tag + _LENGTH.pack(len(blob)), blob]


OUT_OF_BAND = apart.LEAST
"""In the answer to a rollout, a buffer (an array's data) this large travels after the pickle,
not inside it: not copied into the pickle by the agent, nor out of it by the pool."""


def _large(value: object) -> bool:
    return type(value) is bytes and len(value) >= OUT_OF_BAND


def submit(body: Sequence[tuple[int, Command]]) -> list[bytes | memoryview]:
    """A round's commands as :data:`SUBMIT` (:func:`header_apart`), or as
    :data:`SUBMIT_APART` when a rollout's carries a large frame: its bytes after the pickle, as
    they are (the pool sends a version's megabytes to each node without pickling them again
    for each). Read by :func:`read_submit`."""
    if not any(isinstance(c, Sample) and (_large(c.weights) or _large(c.policy)) for _, c in body):
        return [*header_apart(SUBMIT, body)]
    wrapped: dict[int, _Frame] = {}  # one per frame: the workers' commands share it

    def wrap(frame: Any) -> Any:
        if not _large(frame):
            return frame
        if id(frame) not in wrapped:
            wrapped[id(frame)] = _Frame(pickle.PickleBuffer(frame))
        return wrapped[id(frame)]

    apart_body = [(worker, _frames(command, wrap)) for worker, command in body]
    blob, buffers = apart.dumps(apart_body, OUT_OF_BAND)
    return [SUBMIT_APART, *apart.laid_out(blob, buffers, at=1, pad_end=True)]


def read_submit(view: memoryview) -> tuple[Any, int]:
    """What :func:`submit` wrote (a frame apart comes back as ``bytes`` of its own, one per
    frame, not a view of the message), and the offset of what follows it."""
    if view[:1] != SUBMIT_APART:
        return read_header(view)
    body, at = apart.loads(view, 1)
    unwrapped: dict[int, bytes] = {}

    def unwrap(frame: Any) -> Any:
        if not isinstance(frame, _Frame):
            return frame
        if id(frame) not in unwrapped:  # copied out once, however many commands share it
            unwrapped[id(frame)] = bytes(frame.data)
        return unwrapped[id(frame)]

    return [(worker, _frames(command, unwrap)) for worker, command in body], at


class _Frame:
    """A large frame in a :data:`SUBMIT_APART` message: its bytes out of band (the object is
    pickled once however many commands hold it)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return _Frame, (self.data,)


def _frames(command: Command, change: Callable[[Any], Any]) -> Command:
    """``command`` with a :class:`~envfleet.protocol.Sample`'s weights and policy changed by
    ``change`` (the same command when nothing changed)."""
    if not isinstance(command, Sample):
        return command
    weights, policy = change(command.weights), change(command.policy)
    if weights is command.weights and policy is command.policy:
        return command
    return dataclasses.replace(command, weights=weights, policy=policy)


def header_parts(tag: bytes, body: Any, out_of_band: bool = False) -> list[bytes | memoryview]:
    """``tag``, then ``body`` pickled (its length first); with ``out_of_band``, its large
    buffers after it: their count and lengths, then each, 16-byte aligned in the message, as
    it is (:mod:`envfleet.out_of_band`; the parts are written by one ``writev``, not joined).
    Read by :func:`read_header_parts`, whose arrays are then views of the message: only for
    what the pool copies out at once (a rollout's parts), else a value the caller keeps would
    keep the whole message alive."""
    if out_of_band:
        blob, buffers = apart.dumps(body, OUT_OF_BAND)
    else:
        blob, buffers = pickle.dumps(body, protocol=5), []
    return [tag, *apart.laid_out(blob, buffers, at=len(tag), pad_end=True)]


def read_header_parts(data: Any) -> tuple[Any, int]:
    """What :func:`header_parts` wrote after its tag, and the offset of what follows it: the
    large buffers' arrays are views of ``data`` (of a copy if ``data`` is read-only: they
    are writable, as those pickled inside are)."""
    view = memoryview(data)
    (size,) = _LENGTH.unpack_from(view, 1)
    (count,) = _LENGTH.unpack_from(view, 1 + _LENGTH.size + size)
    if count and view.readonly:
        view = memoryview(bytearray(view))
    return apart.loads(view, 1)


def read_header(data: Any) -> tuple[Any, int]:
    """The pickled body after a tag, and the offset of what follows it."""
    return read_pickled(data, 1)


Portable = tuple[Any, ...]
"""An :class:`~envfleet.errors.EnvError` in a form that pickles (the error itself does not:
its ``__init__`` takes keyword arguments, and an env's error is an instance of a class made on
the fly), see :func:`portable` and :func:`rebuild`."""


def portable(exc: EnvError) -> Portable:
    """``exc`` as plain data, to cross to the pool."""
    if isinstance(exc, WorkerDiedError):
        return (
            "died",
            isinstance(exc, EnvTimeoutError),
            str(exc),
            exc.env_index,
            exc.phase,
            exc.worker,
            exc.exitcode,
            exc.env_ids,
        )
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return ("raised", EnvFailure.capture(exc.env_index, exc.phase, cause), exc.worker)


def rebuild(data: Portable, workers: Sequence[int], env_name: str) -> Exception:
    """The error :func:`portable` describes, naming the pool's worker (``workers``: the pool's
    index of each of the agent's workers); ``("missing", message)``: a module the node lacks,
    an ``ImportError``."""
    if data[0] == "missing":
        return ImportError(data[1])
    if data[0] == "raised":
        _, failure, worker = data
        error: EnvError = failure.to_error(workers[worker], env_name)
        return error
    _, timeout, message, env_index, phase, worker, exitcode, env_ids = data
    kind = EnvTimeoutError if timeout else WorkerDiedError
    return kind(
        message,
        env_index=env_index,
        phase=phase,
        worker=workers[worker],
        exitcode=exitcode,
        env_ids=env_ids,
    )


__all__ = [
    "ACK",
    "CLOSE",
    "GENERAL",
    "INFOS",
    "KILL",
    "MEMORY",
    "OUT_OF_BAND",
    "PLAIN",
    "REPEAT",
    "RESTART",
    "SUBMIT",
    "SUBMIT_APART",
    "Portable",
    "header",
    "header_apart",
    "header_parts",
    "join_columns",
    "memory",
    "pickled",
    "plain_workers",
    "portable",
    "read_header",
    "read_header_parts",
    "read_memory",
    "read_pickled",
    "read_plain_workers",
    "read_submit",
    "rebuild",
    "submit",
]
