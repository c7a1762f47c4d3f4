"""Lossless compression of image rows between a node agent and the pool (``compress=``).

A node's rows of an image field (an observation of numbers, two or more dimensions a row: frames)
travel as one compressed block per field and message, and the pool decompresses each block
straight into its batch array where the rows are consecutive (they are for a node's sync step),
through the C library's own call (``LZ4_decompress_safe``, zlib's ``uncompress``): the
Python calls (``lz4.block.decompress``, ``zlib.decompress``) return a new buffer each time,
whose page faults and copy cost more than the decoding itself on 100 KB frames. Where that
call cannot be found, or the rows are not consecutive, a block is decompressed and copied.

LZ4 refuses a block of more than :data:`LZ4_BLOCK` bytes: a field's rows past it travel as
several blocks of that many bytes (the last shorter), each its compressed length first
(8 bytes); both ends know the rows' size, so a field of one block travels as before.

``"lz4"`` (the ``lz4`` package, in the ``ray`` extra) decodes a Pong frame several times
faster than ``"zlib"`` (the standard library, level 1), which sends slightly fewer bytes:
``bench/cluster.py`` measures both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import struct
import zlib
from typing import Any

import numpy as np

from envfleet.backends.ray.options import COMPRESS

LZ4_BLOCK = 0x7E000000
"""The most bytes LZ4 compresses as one block (its ``LZ4_MAX_INPUT_SIZE``)."""

_INT_MAX = 0x7FFFFFFF  # LZ4's sizes are C ints: a compressed block may be past LZ4_BLOCK
_BLOCK_SIZE = struct.Struct("<Q")


class Codec:
    """One way to compress a field's rows: ``compress`` on the node, ``decompress_into`` on
    the pool."""

    name = ""

    def compress(self, data: Any) -> bytes:
        """``data`` (a buffer) compressed."""
        raise NotImplementedError

    def decompress(self, data: np.ndarray, size: int) -> bytes:
        """The ``size`` bytes that ``data`` (a ``uint8`` array) holds compressed."""
        raise NotImplementedError

    def _into(self) -> Any:
        """The C call ``(source, source size, destination, destination size)`` that
        decompresses straight into memory (``True``: done; ``False``: not a block of that size;
        ``None``: too large for it), or ``None``."""
        return None

    def decompress_into(self, data: np.ndarray, out: np.ndarray) -> None:
        """Decompress ``data`` (a ``uint8`` array) into ``out``, which it must fill exactly.

        Raises:
            ValueError: ``data`` is not a block of exactly ``out.nbytes`` bytes.
        """
        into = self._into()
        if into is not None and out.flags.c_contiguous and out.flags.writeable:
            done = into(data.ctypes.data, data.size, out.ctypes.data, out.nbytes)
            if done is False:
                raise ValueError(f"a {self.name} block that does not hold {out.nbytes} bytes")
            if done:
                return
        raw = self.decompress(data, out.nbytes)
        if len(raw) != out.nbytes:
            raise ValueError(f"a {self.name} block that does not hold {out.nbytes} bytes")
        out[...] = np.frombuffer(raw, out.dtype).reshape(out.shape)


class Lz4(Codec):
    """LZ4 blocks (``lz4.block``, the size not stored: the pool knows it)."""

    name = "lz4"
    block = LZ4_BLOCK
    """The most bytes of rows compressed as one block: more travel as several."""

    def __init__(self) -> None:
        import lz4.block  # the ray extra installs it
        import lz4.block._block

        self._block = lz4.block
        self._library = lz4.block._block.__file__

    def compress(self, data: Any) -> bytes:
        """``data`` (a contiguous buffer) as one block, or, past :attr:`block` bytes, as one
        block per :attr:`block` bytes, each its compressed length first."""
        view = memoryview(data).cast("B")
        step = self.block
        if view.nbytes <= step:
            out: bytes = self._block.compress(view, store_size=False)
            return out
        parts = []
        for start in range(0, view.nbytes, step):
            blob = self._block.compress(view[start : start + step], store_size=False)
            parts += [_BLOCK_SIZE.pack(len(blob)), blob]
        return b"".join(parts)

    def decompress_into(self, data: np.ndarray, out: np.ndarray) -> None:
        """As :meth:`Codec.decompress_into`, for rows of one block or of several.

        Raises:
            ValueError: ``data`` does not hold exactly ``out.nbytes`` bytes.
        """
        step = self.block
        if out.nbytes <= step:
            super().decompress_into(data, out)
            return
        direct = out.flags.c_contiguous and out.flags.writeable
        flat = out.reshape(-1).view(np.uint8) if direct else np.empty(out.nbytes, np.uint8)
        at = 0
        for start in range(0, out.nbytes, step):
            if at + _BLOCK_SIZE.size > data.size:
                raise ValueError(f"lz4 blocks that do not hold {out.nbytes} bytes")
            (size,) = _BLOCK_SIZE.unpack(data[at : at + _BLOCK_SIZE.size].tobytes())
            at += _BLOCK_SIZE.size
            super().decompress_into(data[at : at + size], flat[start : start + step])
            at += size
        if at != data.size:
            raise ValueError(f"lz4 blocks that do not hold {out.nbytes} bytes")
        if not direct:
            out[...] = flat.view(out.dtype).reshape(out.shape)

    def decompress(self, data: np.ndarray, size: int) -> bytes:
        out: bytes = self._block.decompress(data, uncompressed_size=size)
        return out

    def _into(self) -> Any:
        return _lz4_into(self._library)


class Zlib(Codec):
    """zlib streams at level 1 (the standard library)."""

    name = "zlib"

    def compress(self, data: Any) -> bytes:
        return zlib.compress(data, 1)

    def decompress(self, data: np.ndarray, size: int) -> bytes:
        return zlib.decompress(data.data, bufsize=max(size, 1))

    def _into(self) -> Any:
        return _zlib_into()


def codec(name: str | None) -> Codec | None:
    """The codec ``compress=name`` asks for (``None``: none).

    Raises:
        ValueError: an unknown name.
        ImportError: ``"lz4"`` without the ``lz4`` package.
    """
    if name is None:
        return None
    if name == "zlib":
        return Zlib()
    if name == "lz4":
        try:
            return Lz4()
        except ImportError as exc:
            raise ImportError(
                "compress='lz4' needs the lz4 package: pip install 'envfleet[ray]' "
                "(or pip install lz4), on every node; or compress='zlib'",
                name="lz4",
            ) from exc
    choices = ", ".join(map(repr, COMPRESS))
    raise ValueError(f"compress must be one of {choices} or None, got {name!r}")


def compressible(field: np.ndarray) -> bool:
    """Whether a batch field's rows are images: numbers of two or more dimensions a row
    (``uint8`` frames, and float frames as RLlib's Atari wrappers give them, which compress
    as well: a float32 Pong frame ~100x)."""
    return field.dtype.kind in "biuf" and field.ndim >= 3


@functools.cache
def _lz4_into(module_file: str) -> Any:
    """``LZ4_decompress_safe`` from the library the ``lz4`` package carries, or ``None``."""
    try:
        call = ctypes.CDLL(module_file).LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_int
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

    def into(src: int, src_size: int, dst: int, dst_size: int) -> bool | None:
        if src_size > _INT_MAX or dst_size > LZ4_BLOCK:
            return None
        return bool(call(src, dst, src_size, dst_size) == dst_size)

    return into


@functools.cache
def _zlib_into() -> Any:
    """zlib's ``uncompress`` (the library the standard ``zlib`` module uses), or ``None``."""
    name = ctypes.util.find_library("z")
    if name is None:
        return None
    try:
        call = ctypes.CDLL(name).uncompress
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_int
    call.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.c_void_p,
        ctypes.c_ulong,
    ]

    def into(src: int, src_size: int, dst: int, dst_size: int) -> bool:
        size = ctypes.c_ulong(dst_size)
        return bool(call(dst, ctypes.byref(size), src, src_size) == 0 and size.value == dst_size)

    return into


__all__ = ["LZ4_BLOCK", "Codec", "Lz4", "Zlib", "codec", "compressible"]
