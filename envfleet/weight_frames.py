"""A version of a policy's weights as one frame: inline bytes, or a shared segment of a machine.

A policy with weights apart from its code (``policy.weights()``, a mapping of names to arrays)
ships each version once (:mod:`envfleet.shipping`). The mapping is pickled once into a *frame*:
the pickle, then each large buffer (an array's data, pickle's protocol 5 out of band) at an
aligned offset after it::

    frame: header (magic, digest, pickle size, buffers) | table (offset, size per buffer)
           | pickle | buffer 0 | buffer 1 | ...

A frame crosses a wire as bytes (to a node's agent, a Ray actor, a thread of the pool's own
process). Where a machine runs several worker processes (the process backend's, a node agent's),
the pool's side of that machine writes each frame once into a segment of anonymous shared memory
(:class:`Segment`: a sealed memfd) and each worker's command carries only a
:class:`SegmentRef`: the process that holds the segment, its descriptor, size, digest and
version (a policy's large code, pickled whole with the weights it holds, goes the same way). A
worker maps the segment copy-on-write (``/proc/<pid>/fd/<fd>``): its arrays are views of the
node's one copy, writable without touching the others' (no copy in at all while nothing
writes). A memfd has no name: it is freed with the last process that holds or maps it, so
nothing outlives the processes, whatever way they end. :func:`load` reads either form.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envfleet import out_of_band
from envfleet.recycling import map_peer

MAGIC = b"EFWEIGHT"
"""What every frame starts with."""

_HEADER = struct.Struct("<8s16sQQ")  # magic, digest, pickle size, buffers
_ENTRY = struct.Struct("<QQ")  # offset, size of one buffer
_ALIGN = 64
OUT_OF_BAND = 4096
"""Buffers at least this large go after the pickle (views when read from a segment); smaller
ones inside it."""


def pack(weights: Mapping[str, Any], hashed: bool = True) -> bytes:
    """``weights`` as one frame (their data copied once, into it). Its digest is of its
    contents when ``hashed`` (what tells a changed version from the same one), else a token of
    its own: it only tells the frame from every other, at no cost (a hash of a CNN's 7 MB cost
    the pool's process 7 ms a version)."""
    body, buffers = out_of_band.dumps(weights, OUT_OF_BAND)
    hasher = hashlib.blake2b(body if hashed else os.urandom(16), digest_size=16)
    at = _HEADER.size + _ENTRY.size * len(buffers) + len(body)
    entries: list[bytes] = []
    pieces: list[bytes | memoryview] = [body]
    for raw in buffers:
        pad = -at % _ALIGN
        pieces.append(bytes(pad))
        at += pad
        entries.append(_ENTRY.pack(at, raw.nbytes))
        pieces.append(raw)
        at += raw.nbytes
        if hashed:
            hasher.update(raw)
    header = _HEADER.pack(MAGIC, hasher.digest(), len(body), len(buffers))
    return b"".join([header, *entries, *pieces])


def is_frame(data: bytes) -> bool:
    """Whether ``data`` is a frame (else a plain pickle, as a command built by hand carries)."""
    return data[: len(MAGIC)] == MAGIC


def digest(frame: bytes | memoryview | mmap.mmap) -> bytes:
    """The digest of a frame's contents (16 bytes), as :func:`pack` wrote it."""
    magic, value, _, _ = _HEADER.unpack_from(frame, 0)
    if magic != MAGIC:
        raise ValueError("not a frame of weights")
    return bytes(value)


def unpack(frame: bytes | memoryview | mmap.mmap, copy: bool) -> Any:
    """The mapping a frame holds; ``copy``: its large arrays in memory of their own (else views
    of ``frame``, read-only where it is)."""
    view = memoryview(frame)
    magic, _, size, count = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise ValueError("not a frame of weights")
    at = _HEADER.size + _ENTRY.size * count
    buffers: list[Any] = []
    for k in range(count):
        offset, nbytes = _ENTRY.unpack_from(view, _HEADER.size + _ENTRY.size * k)
        buffer = view[offset : offset + nbytes]
        buffers.append(bytearray(buffer) if copy else buffer)
    return pickle.loads(view[at : at + size], buffers=buffers)


@dataclass(frozen=True)
class SegmentRef:
    """Where bytes of a command (a frame of weights, or a policy's code) are on this machine:
    what a worker's command carries instead of them."""

    pid: int
    """The process that holds the segment."""
    fd: int
    """Its descriptor there."""
    size: int
    """The bytes it holds (after its header)."""
    digest: bytes
    """Their digest: what the worker checks it mapped (a descriptor number is reused)."""
    version: int
    """The version of the weights (of the policy, for its code) that it holds."""


class SegmentUnreadable(OSError):
    """A worker could not map the segment a :class:`SegmentRef` names."""


def load(weights: bytes | SegmentRef) -> Any:
    """The mapping of names to arrays a command's weights hold, inline or in a segment."""
    if isinstance(weights, SegmentRef):
        return unpack(mapped(weights), copy=False)
    if not is_frame(weights):
        return pickle.loads(weights)
    return unpack(weights, copy=True)  # each worker its own arrays, as a pickle would give


def code(policy: bytes | SegmentRef) -> bytes | memoryview:
    """A command's policy code, inline or in a segment (to unpickle: nothing keeps a view)."""
    return mapped(policy) if isinstance(policy, SegmentRef) else policy


_SEGMENT = struct.Struct("<8s16sQ")  # magic, digest, size; the bytes start at _ALIGN
_SEGMENT_MAGIC = b"EFSEGMNT"


def mapped(ref: SegmentRef) -> memoryview:
    """The bytes of the segment ``ref`` names, mapped copy-on-write (writable, private to this
    process: no copy until it writes), their digest checked."""
    what = f"the segment of version {ref.version}"
    try:
        memory = map_peer(ref.pid, ref.fd, _ALIGN + ref.size, write=False, what=what)
    except OSError as exc:  # not (any more) the segment
        raise SegmentUnreadable(str(exc)) from exc
    if _SEGMENT.unpack_from(memory, 0) != (_SEGMENT_MAGIC, ref.digest, ref.size):
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        raise SegmentUnreadable(f"{path} holds other bytes than version {ref.version}'s")
    return memoryview(memory)[_ALIGN:]


class Segment:
    """Bytes in anonymous shared memory (a sealed memfd), held by this process: a header
    (magic, digest, size), then the bytes at an aligned offset (a frame's buffers stay
    aligned)."""

    def __init__(self, data: bytes, data_digest: bytes) -> None:
        flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
        fd = os.memfd_create("envfleet-weights", flags)
        try:
            header = _SEGMENT.pack(_SEGMENT_MAGIC, data_digest, len(data))
            for chunk in (header + bytes(_ALIGN - len(header)), data):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            seals = ("F_SEAL_WRITE", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")
            with contextlib.suppress(ImportError, AttributeError, OSError):
                import fcntl  # Linux: the contents can no longer change under a mapping

                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sum(getattr(fcntl, s) for s in seals))
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.size = len(data)
        self.digest = data_digest

    def ref(self, version: int) -> SegmentRef:
        """What a command carries for this segment."""
        assert self.fd is not None
        return SegmentRef(os.getpid(), self.fd, self.size, self.digest, version)

    def close(self) -> None:
        """Let go of it: freed once no worker maps it any more."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def segments_available() -> bool:
    """Whether this machine has memfd segments that its processes can open by ``/proc``."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


__all__ = [
    "MAGIC",
    "OUT_OF_BAND",
    "Segment",
    "SegmentRef",
    "SegmentUnreadable",
    "code",
    "digest",
    "is_frame",
    "load",
    "mapped",
    "pack",
    "segments_available",
    "unpack",
]
