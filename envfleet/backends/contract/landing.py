"""Large replies on a process worker's reply pipe: arrays after the pickle; a rollout's part read
straight into the rollout's arrays.

A reply with large arrays carries them after its pickle, as they are (a
:data:`~envfleet.backends.contract.framing.BUFFERS` frame, laid out by
:mod:`envfleet.out_of_band`), and a reply pipe is widened (:func:`widen`) before its first. A
rollout's part goes further:

::

    worker: PARTS | length | the reply pickled, each part's recorded arrays swapped for Raw
            | length | those arrays' bytes, in order            (one writev, from the arrays)
    pool:   the reply unpickled as soon as its pickle is in; where each part's arrays go
            (raw_parts.destinations: the rollout's columns the pool gave for those envs, where
            they fit, else new arrays); the bytes read into them by readv as they come

What :mod:`~envfleet.backends.contract.raw_parts` does for a node's answer over its socket,
here for one worker's reply (:func:`encode_parts`, :class:`Landing`), so that a rollout of
frames on one machine costs the pool's process one copy of each frame, the kernel's.
"""

from __future__ import annotations

import contextlib
import fcntl
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from envfleet.backends.contract import raw_parts
from envfleet.protocol import Reply
from envfleet.rollout_loop import Sampled

__all__ = [
    "IOV_MAX",
    "PARTS",
    "PIPE_SIZE",
    "READ_AHEAD",
    "Landing",
    "ReplyPickler",
    "encode_parts",
    "widen",
]

PARTS = 4
"""Tag of a reply that holds a rollout's part: the pickle's length, the reply pickled (its parts'
recorded arrays swapped for :class:`~envfleet.backends.contract.raw_parts.Raw`), the length of
those arrays' bytes, and the bytes."""
IOV_MAX = 1024
"""The most buffers one ``readv``/``writev`` takes (Linux's ``IOV_MAX``)."""
READ_AHEAD = 1 << 20
"""The bytes of buffers one ``readv`` of a part is given (past a widened pipe's capacity)."""
PIPE_SIZE = 1 << 18
"""The capacity a reply pipe is widened to before its first reply with large arrays: the
default 64 KB had the pool read a rollout's part some 20 KB at a time (Pong frames as float32
on 2 workers: 108 µs of the pool's CPU an env-step at 64 KB, 68 at 256 KB, 74 at 1 MB). Only
then: pipes count against a user's pipe memory, which bounds the next pipes' capacity."""
_LENGTH = struct.Struct("<Q")
_TAG = bytes([PARTS])


def widen(fd: int) -> bool:
    """Widen the pipe ``fd`` to :data:`PIPE_SIZE` where the system allows it (Linux); whether
    that was tried (a refusal leaves it as it was)."""
    setting = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setting is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, setting, PIPE_SIZE)
    return True


class ReplyPickler(ForkingPickler):
    """``ForkingPickler`` (its reducers: descriptors, connections) that takes a
    ``buffer_callback``, which its own constructor does not."""

    def __init__(self, file: Any, protocol: int, *, buffer_callback: Any = None) -> None:
        pickle.Pickler.__init__(self, file, protocol, buffer_callback=buffer_callback)
        # What ForkingPickler's constructor sets: copyreg's reducers and those registered
        self.dispatch_table = self._copyreg_dispatch_table.copy()  # type: ignore[attr-defined]
        self.dispatch_table.update(self._extra_reducers)  # type: ignore[attr-defined]


def encode_parts(reply: Reply) -> list[bytes | memoryview] | None:
    """``reply`` as a :data:`PARTS` frame (pieces for one ``writev``), when it holds a
    rollout's part; ``None`` otherwise. Its parts' arrays are swapped out of ``reply``
    (the worker's, dropped once sent). Raises what pickling it raises."""
    arrays = raw_parts.strip([reply])
    if arrays is None:
        return None
    body = ForkingPickler.dumps(reply)  # written from the pickler's own buffer: no copy
    size = sum(a.nbytes for a in arrays)
    return [_TAG + _LENGTH.pack(len(body)), body, _LENGTH.pack(size), *arrays]


class Landing:
    """Bytes that go straight where they belong, as they come: a :data:`PARTS` frame's (its
    pickle in: its reply, and its parts' arrays), a large reply's whole body (:meth:`whole`),
    a node's frame of parts (``reply`` ``None``). They come by :meth:`fill` from bytes at hand,
    or :meth:`iovecs` and :meth:`advance` around a ``readv``; :meth:`reply` once :attr:`done`.
    ``ValueError`` if ``buffers`` do not hold ``size`` bytes."""

    def __init__(
        self, reply: Reply | Callable[[], Any] | None, buffers: Sequence[Any], size: int
    ) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        if sum(v.nbytes for v in views) != size:
            raise ValueError(f"{size} bytes due, where the buffers hold another number")
        self._reply = reply
        self._views = [v for v in views if v.nbytes]
        self._k = 0  # the buffer being filled
        self._at = 0  # its bytes in

    @classmethod
    def of(
        cls,
        pickled: Any,
        size: int,
        given: Mapping[tuple[int, ...], Sampled],
        empty: Callable[..., np.ndarray] = np.empty,
    ) -> Landing:
        """The reply ``pickled`` holds, its parts' arrays those ``given`` for their envs where
        they fit (each taken out of ``given``), else new ones (made by ``empty``); ``size``:
        their bytes."""
        reply = pickle.loads(pickled)
        buffers: list[np.ndarray] = []
        for part in raw_parts.stripped(reply):
            into = given.pop(part.env_ids, None) if isinstance(given, dict) else None
            buffers += raw_parts.destinations(part, into, empty)
        return cls(reply, buffers, size)

    @classmethod
    def whole(cls, body: np.ndarray, got: int, decode: Callable[[], Any]) -> Landing:
        """A large reply's ``body`` (``got`` bytes of it in already), ``decode``-d once full."""
        landing = cls(decode, [body], body.nbytes)
        landing.advance(got)
        return landing

    @property
    def done(self) -> bool:
        return self._k == len(self._views)

    def reply(self) -> Any:
        """What the frame holds (its bytes all in)."""
        reply = self._reply
        return reply() if callable(reply) else reply

    def iovecs(self) -> list[memoryview]:
        """Where the next bytes go, for one ``readv``: a pipe's worth or so (a read takes
        what the pipe holds: more buffers would only cost their views)."""
        k, views = self._k, self._views
        out = [views[k][self._at :]]
        room = out[0].nbytes
        while room < READ_AHEAD and k + len(out) < len(views) and len(out) < IOV_MAX:
            out.append(views[k + len(out)])
            room += out[-1].nbytes
        return out

    def advance(self, n: int) -> None:
        """``n`` more bytes are in."""
        views = self._views
        while n:
            left = views[self._k].nbytes - self._at
            if n < left:
                self._at += n
                return
            n -= left
            self._k, self._at = self._k + 1, 0

    def fill(self, data: bytes | bytearray | memoryview) -> int:
        """Copy the first bytes of ``data`` in; how many it took (all, or those still due)."""
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view) and not self.done:
            n = min(self._views[self._k].nbytes - self._at, len(view) - taken)
            self._views[self._k][self._at : self._at + n] = view[taken : taken + n]
            taken += n
            self.advance(n)
        return taken
