"""The node wire's compressed rows (``compress=``), without a cluster: every codec, straight
into the batch arrays or through a copy, consecutive rows or not, gives back the same bits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from envfleet.backends.nodes import raw_rows
from envfleet.backends.nodes.compression import Codec, codec, compressible


def fields(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Row fields as a node batch has them: an image, a float vector, rewards, flags."""
    frames = np.zeros((n, 21, 16, 3), np.uint8)
    frames[:, 5:9, 2:7] = rng.integers(0, 256, (n, 4, 5, 3))
    return [
        frames,
        rng.normal(size=(n, 3)).astype(np.float32),
        rng.normal(size=n),
        rng.integers(0, 2, n).astype(bool),
    ]


@pytest.mark.parametrize("name", ["lz4", "zlib"])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("sel", [slice(2, 6), np.array([0, 3, 5, 6])])
def test_rows_round_trip(name: str, direct: bool, sel: Any, monkeypatch: Any) -> None:
    rng = np.random.default_rng(0)
    source = fields(8, rng)
    squeeze = codec(name)
    assert squeeze is not None
    if not direct:  # as where the C library's call is not found
        monkeypatch.setattr(type(squeeze), "_into", lambda self: None)
    codecs = raw_rows.row_codecs(source, squeeze)
    assert codecs is not None and [c is not None for c in codecs] == [True, False, False, False]
    data = b"X" + b"".join(raw_rows.pack(source, sel, codecs)) + b"tail"
    raw = sum(f[sel].nbytes for f in source)
    assert len(data) < raw  # the frames were compressed
    target = [np.zeros_like(f) for f in source]
    end = raw_rows.unpack(target, sel, len(source[0][sel]), data, 1, codecs)
    assert data[end:] == b"tail"
    for got, want in zip(target, source, strict=True):
        np.testing.assert_array_equal(got[sel], want[sel])
        rest = np.ones(len(want), bool)
        rest[sel] = False
        assert not got[rest].any()  # nothing written outside the rows


def test_no_rows_send_nothing() -> None:
    source = fields(4, np.random.default_rng(1))
    codecs = raw_rows.row_codecs(source, codec("lz4"))
    data = b"".join(raw_rows.pack(source, slice(0, 0), codecs))
    assert raw_rows.unpack(source, slice(0, 0), 0, b"X" + data, 1, codecs) == 1


@pytest.mark.parametrize("name", ["lz4", "zlib"])
def test_a_block_of_the_wrong_size_is_refused(name: str) -> None:
    squeeze = codec(name)
    assert squeeze is not None
    block = np.frombuffer(squeeze.compress(bytes(100)), np.uint8)
    with pytest.raises(ValueError, match="does not hold 120 bytes"):
        squeeze.decompress_into(block, np.zeros(120, np.uint8))
    with pytest.raises(ValueError, match="does not hold 80 bytes"):
        squeeze.decompress_into(block, np.zeros(80, np.uint8))


def test_only_images_are_compressed_and_names_are_checked() -> None:
    assert compressible(np.zeros((4, 2, 2), np.uint8))
    assert not compressible(np.zeros((4, 2), np.uint8))
    assert compressible(np.zeros((4, 2, 2), np.float32))  # float frames too
    assert not compressible(np.zeros((4, 2, 2), object))
    assert raw_rows.row_codecs([np.zeros((4, 2), np.float32)], codec("zlib")) is None
    assert codec(None) is None
    with pytest.raises(ValueError, match="compress must be one of 'lz4', 'zlib' or None"):
        codec("gzip")
    assert isinstance(codec("zlib"), Codec)


class _StrictLz4:
    """``lz4.block`` as LZ4 itself behaves past its block limit, with a limit of ``limit``
    bytes: a larger block is refused, as LZ4 refuses one of more than 0x7E000000 bytes."""

    def __init__(self, real: Any, limit: int) -> None:
        self.real, self.limit, self.blocks = real, limit, 0

    def compress(self, data: Any, **kwargs: Any) -> bytes:
        if memoryview(data).nbytes > self.limit:
            raise ValueError("input too large")  # what lz4.block says past its limit
        self.blocks += 1
        out: bytes = self.real.compress(data, **kwargs)
        return out

    def decompress(self, data: Any, uncompressed_size: int) -> bytes:
        if uncompressed_size > self.limit:
            raise ValueError("output too large")
        out: bytes = self.real.decompress(data, uncompressed_size=uncompressed_size)
        return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("sel", [slice(1, 7), np.array([0, 3, 5, 6, 7])])
def test_lz4_rows_past_its_block_limit_travel_as_several_blocks(
    direct: bool, sel: Any, monkeypatch: Any
) -> None:
    """A field's rows larger than LZ4's block limit (2 GB; 1000 bytes here) are split into
    blocks of the limit and come back whole, straight into the batch or through a copy."""
    squeeze = codec("lz4")
    assert squeeze is not None
    limit = 1000
    strict = _StrictLz4(squeeze._block, limit)  # type: ignore[attr-defined]
    monkeypatch.setattr(squeeze, "_block", strict)
    monkeypatch.setattr(squeeze, "block", limit)
    if not direct:
        monkeypatch.setattr(type(squeeze), "_into", lambda self: None)
    source = fields(8, np.random.default_rng(3))  # 1008 bytes of frame a row
    codecs = raw_rows.row_codecs(source, squeeze)
    data = b"X" + b"".join(raw_rows.pack(source, sel, codecs)) + b"tail"
    rows = len(source[0][sel])
    assert strict.blocks == -(-rows * source[0][0].nbytes // limit)  # ceil: the last shorter
    target = [np.zeros_like(f) for f in source]
    end = raw_rows.unpack(target, sel, rows, data, 1, codecs)
    assert data[end:] == b"tail"
    for got, want in zip(target, source, strict=True):
        np.testing.assert_array_equal(got[sel], want[sel])


def test_lz4_blocks_that_do_not_fill_the_rows_are_refused(monkeypatch: Any) -> None:
    squeeze = codec("lz4")
    assert squeeze is not None
    monkeypatch.setattr(squeeze, "block", 100)
    blocks = np.frombuffer(squeeze.compress(bytes(range(250))), np.uint8)
    out = np.zeros(250, np.uint8)
    squeeze.decompress_into(blocks, out)
    assert out.tobytes() == bytes(range(250))
    with pytest.raises(ValueError, match="blocks that do not hold 200 bytes"):
        squeeze.decompress_into(blocks, np.zeros(200, np.uint8))  # a block left over
    with pytest.raises(ValueError, match="does not hold 100 bytes"):
        squeeze.decompress_into(blocks, np.zeros(300, np.uint8))  # the last block short
