"""Whole messages from a pool-agent connection (:class:`~envfleet.backends.nodes.frames.Frames`),
as ``multiprocessing``'s ``Connection.send_bytes`` frames them, read in as few reads as the
bytes allow."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from envfleet.backends.nodes import frames as node_frames
from envfleet.backends.nodes.frames import Frames


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Frames, socket.socket]]:
    """A sending connection, and the frames of the other end (its socket, to close it)."""
    a, b = socket.socketpair()
    sender = Connection(a.detach())
    yield sender, Frames(b.fileno()), b
    sender.close()
    b.close()


class CountedReads:
    """``os.read`` of the module under test, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self._read = os.read
        monkeypatch.setattr(node_frames.os, "read", self)

    def __call__(self, fd: int, n: int) -> bytes:
        self.calls += 1
        return self._read(fd, n)


def test_a_small_message_is_one_read(
    pair: tuple[Connection, Frames, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, frames, _ = pair
    reads = CountedReads(monkeypatch)
    sender.send_bytes(b"R" + bytes(range(200)))
    assert frames.read() == b"R" + bytes(range(200))
    assert reads.calls == 1  # recv_bytes reads its length, then its body


def test_messages_read_together_wait_whole_for_the_next_read(
    pair: tuple[Connection, Frames, socket.socket],
) -> None:
    sender, frames, _ = pair
    sender.send_bytes(b"first")
    sender.send_bytes(b"")
    sender.send_bytes(b"third")
    assert not frames.whole() and frames.ready()
    assert frames.read() == b"first"
    # The rest came with the first read: the socket has nothing more, the frames have it.
    assert frames.whole() and frames.ready() and not frames._poller.poll(0)
    assert frames.read() == b""
    assert frames.read() == b"third"
    assert not frames.whole() and not frames.ready()


def test_a_message_in_pieces_is_read_whole(pair: tuple[Connection, Frames, socket.socket]) -> None:
    sender, frames, _ = pair
    data = struct.pack("!i", 10) + b"0123456789" + struct.pack("!i", 2) + b"ab"
    pieces = [data[:2], data[2:7], data[7:16]]  # its length split, then its body
    for piece in pieces:
        os.write(sender.fileno(), piece)
        assert not frames.whole()
    assert frames.ready()  # bytes to read (not a whole message: a read would wait for it)
    writer = threading.Timer(0.05, os.write, (sender.fileno(), data[16:]))
    writer.start()
    assert frames.read() == b"0123456789"
    writer.join()
    assert frames.read() == b"ab"


def test_a_large_message_is_read_into_place(
    pair: tuple[Connection, Frames, socket.socket],
) -> None:
    sender, frames, _ = pair
    large = os.urandom(5 * node_frames.CHUNK + 123)
    data = struct.pack("!i", len(large)) + large + struct.pack("!i", 1) + b"n"
    os.write(sender.fileno(), data[:1000])  # its start in before the first read: read with it
    writer = threading.Thread(target=os.write, args=(sender.fileno(), data[1000:]))
    writer.start()
    got = frames.read()
    assert len(got) == len(large) and bytes(got) == large
    assert frames.read() == b"n"
    writer.join()


def test_a_message_is_read_straight_into_the_buffers_given(
    pair: tuple[Connection, Frames, socket.socket],
) -> None:
    """Into buffers of any sizes, more than one ``readv`` takes (columns of each step of a
    rollout's arrays): what was read ahead with the message before it first, then the socket;
    the message after it is read whole, as always."""
    sender, frames, _ = pair
    columns = np.zeros((1500, 6, 3), np.float32)  # the buffers: 2 columns of each step
    want = np.arange(1500 * 2 * 3, dtype=np.float32).reshape(1500, 2, 3)
    buffers = [row.reshape(-1).view(np.uint8) for row in columns[:, 2:4]]
    first = b"S" + bytes(100)
    body = want.tobytes()
    framed = [struct.pack("!i", len(first)), first, struct.pack("!i", len(body)), body]
    data = b"".join([*framed, struct.pack("!i", 4), b"next"])
    os.write(sender.fileno(), data[:3000])  # the first read takes some of it
    writer = threading.Thread(target=os.write, args=(sender.fileno(), data[3000:]))
    writer.start()
    assert frames.read() == first
    frames.read_into(buffers)
    np.testing.assert_array_equal(columns[:, 2:4], want)
    assert not columns[:, :2].any() and not columns[:, 4:].any()  # nothing else touched
    assert frames.read() == b"next"
    writer.join()


def test_a_message_read_into_buffers_of_another_length_or_cut_short_fails(
    pair: tuple[Connection, Frames, socket.socket],
) -> None:
    sender, frames, _ = pair
    sender.send_bytes(bytes(10))
    with pytest.raises(OSError, match="a message of 10 bytes where 12 were due"):
        frames.read_into([bytearray(12)])
    os.write(sender.fileno(), struct.pack("!i", 100) + bytes(40))
    sender.close()
    with pytest.raises(EOFError, match="mid-message"):
        frames.read_into([bytearray(60), bytearray(40)])


def test_the_peer_gone_is_eof_whole_or_mid_message(
    pair: tuple[Connection, Frames, socket.socket],
) -> None:
    sender, frames, _ = pair
    sender.send_bytes(b"last")
    os.write(sender.fileno(), struct.pack("!i", 100) + b"half")
    sender.close()
    assert frames.read() == b"last"
    with pytest.raises(EOFError, match="mid-message"):
        frames.read()


def test_the_length_past_two_gib_is_read_from_its_eight_bytes() -> None:
    header = struct.pack("!i", -1) + struct.pack("!Q", 3 << 31)
    assert node_frames._frame(header[:7]) == (-1, 0)
    assert node_frames._frame(header + b"x") == (3 << 31, 12)
    assert node_frames._frame(struct.pack("!i", 5)) == (5, 4)
