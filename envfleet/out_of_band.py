"""Pickles whose large buffers travel apart, as they are (pickle's protocol 5, out of band).

A message with large arrays (a rollout's part, a call result, a version's weights) is pickled
with each large contiguous buffer kept out of the pickle (:func:`dumps`), and written as::

    pickle length | pickle | buffer count | each buffer's length | (pad) buffer | (pad) ...

(:func:`laid_out`: pieces for one ``writev``, each buffer aligned in the message); the reader
unpickles it with the buffers as views of the message it read (:func:`loads`): no copy out of
the pickle at either end. The process backend's pipes and the nodes' sockets lay their
messages out this way; a version's weights (:mod:`envfleet.weight_frames`) pickle the same way
into a frame of their own.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

__all__ = ["ALIGN", "LEAST", "dumps", "laid_out", "loads"]

LEAST = 1 << 16
"""A buffer this large (an array's data) goes apart from the pickle; smaller ones inside."""
ALIGN = 16
"""Each buffer starts at a multiple of this in the message (a dtype's alignment)."""
_LENGTH = struct.Struct("<Q")


def dumps(
    value: Any, least: int = LEAST, pickler: Callable[..., pickle.Pickler] = pickle.Pickler
) -> tuple[bytes | memoryview, list[memoryview]]:
    """``value`` pickled, and its contiguous buffers of ``least`` bytes or more, apart (views of
    the arrays themselves); ``pickler``: the class that pickles (one with reducers of its own,
    as ``ForkingPickler``'s), called as ``pickle.Pickler`` is."""
    buffers: list[memoryview] = []

    def apart(buffer: pickle.PickleBuffer) -> bool:
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: inside the pickle
            return True
        if raw.nbytes < least:
            return True
        buffers.append(raw)
        return False

    if pickler is pickle.Pickler:
        return pickle.dumps(value, protocol=5, buffer_callback=apart), buffers
    out = io.BytesIO()
    pickler(out, 5, buffer_callback=apart).dump(value)
    return out.getbuffer(), buffers


def laid_out(
    body: bytes | memoryview, buffers: list[memoryview], at: int = 0, pad_end: bool = False
) -> list[bytes | memoryview]:
    """The pieces of ``body`` (a pickle) and its ``buffers`` as the module docstring lays them
    out, the first at offset ``at`` of the message (buffers aligned there); ``pad_end``: what
    follows starts aligned too."""
    head = _LENGTH.pack(len(body))
    sizes = _LENGTH.pack(len(buffers)) + b"".join(_LENGTH.pack(b.nbytes) for b in buffers)
    pieces: list[bytes | memoryview] = [head, body, sizes]
    at += len(head) + len(body) + len(sizes)
    for buffer in buffers:
        if pad := -at % ALIGN:
            pieces.append(bytes(pad))
        pieces.append(buffer)
        at += pad + buffer.nbytes
    if pad_end and (pad := -at % ALIGN):
        pieces.append(bytes(pad))
    return pieces


def loads(view: memoryview, at: int = 0) -> tuple[Any, int]:
    """What :func:`laid_out` wrote at offset ``at`` of ``view``, its large arrays views of
    ``view``; and the offset after it (aligned)."""
    (size,) = _LENGTH.unpack_from(view, at)
    start = at + _LENGTH.size
    at = start + size
    (count,) = _LENGTH.unpack_from(view, at)
    sizes = struct.unpack_from(f"<{count}Q", view, at + _LENGTH.size)
    at += _LENGTH.size * (1 + count)
    buffers = []
    for n in sizes:
        at += -at % ALIGN
        buffers.append(view[at : at + n])
        at += n
    at += -at % ALIGN
    return pickle.loads(view[start : start + size], buffers=buffers), at
