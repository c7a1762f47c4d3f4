"""Lossless compression of image rows between a node agent and the pool (``compress=``).

A node's rows of an image field (a ``uint8`` observation of two or more dimensions: frames)
travel as one compressed block per field and message, and the pool decompresses each block
straight into its batch array where the rows are consecutive (they are for a node's sync step),
through the C library's own call (``LZ4_decompress_safe``, zlib's ``uncompress``): the
Python calls (``lz4.block.decompress``, ``zlib.decompress``) return a new buffer each time,
whose page faults and copy cost more than the decoding itself on 100 KB frames. Where that
call cannot be found, or the rows are not consecutive, a block is decompressed and copied.

``"lz4"`` (the ``lz4`` package, in the ``ray`` extra) decodes a Pong frame several times
faster than ``"zlib"`` (the standard library, level 1), which sends slightly fewer bytes:
``bench/cluster.py`` measures both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import zlib
from typing import Any

import numpy as np

from envfleet.backends.ray_options import COMPRESS


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

    def __init__(self) -> None:
        import lz4.block  # the ray extra installs it
        import lz4.block._block

        self._block = lz4.block
        self._library = lz4.block._block.__file__

    def compress(self, data: Any) -> bytes:
        out: bytes = self._block.compress(data, store_size=False)
        return out

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
    """Whether a batch field's rows are images (``uint8``, two or more dimensions a row)."""
    return field.dtype == np.uint8 and field.ndim >= 3


@functools.cache
def _lz4_into(module_file: str) -> Any:
    """``LZ4_decompress_safe`` from the library the ``lz4`` package carries, or ``None``."""
    try:
        call = ctypes.CDLL(module_file).LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_int
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    limit = 0x7E000000  # LZ4's own limit on a block

    def into(src: int, src_size: int, dst: int, dst_size: int) -> bool | None:
        if src_size > limit or dst_size > limit:
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
