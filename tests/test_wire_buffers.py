"""Replies with large arrays on the process backend's wire: the arrays after the pickle, as they
are, and read by the pool straight into memory of their own.

Oracles: every value and dtype comes back as sent, however the bytes are cut on their way (one
byte at a time across the headers, the pipe's pieces, a plain reply and a small frame right
behind); large arrays come back as writable views of the reply's own memory, small and
non-contiguous ones inside the pickle; a reply pipe is widened before its first such reply; a
rollout of frames on the process backend is the serial backend's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import termios
import threading
import time
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

import envfleet
from envfleet import out_of_band
from envfleet.backends.contract import framing, landing
from envfleet.backends.local import shared_weights
from envfleet.errors import WorkerDiedError
from envfleet.protocol import Reply
from envfleet.rollout_loop import Sampled
from envfleet.rollouts import Out
from tests.envs import FramesEnv


def reply_with_arrays() -> tuple[Reply, dict[str, np.ndarray]]:
    arrays = {
        "frames": np.arange(3 << 18, dtype=np.float32).reshape(3, 256, 1024),  # 3 MB: in place
        "ints": np.arange(1 << 15, dtype=np.int64),  # 256 KB
        "strided": np.arange(1 << 16, dtype=np.int32)[::2],  # not contiguous: in the pickle
        "small": np.ones(7, dtype=np.uint8),
        "fortran": np.asfortranarray(np.arange(1 << 16, dtype=np.int16).reshape(256, 256)),
    }
    return Reply(env_ids=(4, 5), values={4: arrays}, infos={5: {"k": "v"}}), arrays


def check(got: Reply | None, want: dict[str, np.ndarray]) -> None:
    assert isinstance(got, Reply) and got.env_ids == (4, 5) and got.infos == {5: {"k": "v"}}
    assert got.values is not None
    values = got.values[4]
    for name, array in want.items():
        np.testing.assert_array_equal(values[name], array, err_msg=name)
        assert values[name].dtype == array.dtype and values[name].flags.writeable, name
    assert values["frames"].base is not None  # a view: of the reply's own memory
    values["frames"][0, 0, 0] = -1.0  # writable, and not the sender's
    assert want["frames"][0, 0, 0] == 0.0


def wire(reply: Reply) -> bytes:
    encoded = framing.encode_reply(reply)
    return encoded if isinstance(encoded, bytes) else b"".join(bytes(p) for p in encoded)


@pytest.mark.parametrize("piece", [1, 7, 4096, 65536, 1 << 30])
def test_large_arrays_travel_after_the_pickle_however_the_bytes_are_cut(piece: int) -> None:
    reply, arrays = reply_with_arrays()
    encoded = framing.encode_reply(reply)
    assert isinstance(encoded, list) and encoded[0][0] == framing.BUFFERS
    after = encoded[4:]  # the tag and length, the pickle's length, the pickle, the sizes
    apart = [p for p in after if isinstance(p, memoryview) and p.nbytes >= out_of_band.LEAST]
    assert sorted(p.nbytes for p in apart) == [1 << 17, 1 << 18, 3 << 20]  # not copied
    small = wire(Reply(env_ids=(1,), infos={1: {"x": 1}}))
    stream = wire(reply) + framing.PLAIN_BYTES + small + wire(reply)
    reader, out = framing.FrameReader(), []  # type: ignore[var-annotated]
    pieces = range(0, len(stream), piece) if piece > 1 else range(0, 200)
    at = 0
    for start in pieces:  # byte by byte across the headers, then the rest at once
        reader.feed(stream[start : start + piece], out)
        at = start + piece
    if at < len(stream):
        reader.feed(stream[at:], out)
    assert not reader.partial and len(out) == 4
    check(out[0], arrays)
    assert out[1] is None and out[2].infos == {1: {"x": 1}}
    check(out[3], arrays)


def test_a_large_reply_is_read_from_the_pipe_into_its_own_memory() -> None:
    reply, arrays = reply_with_arrays()
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        assert landing.widen(write_end)
        if hasattr(fcntl, "F_GETPIPE_SZ"):
            assert fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) == landing.PIPE_SIZE

        def write() -> None:
            for _ in range(2):
                framing.write_all(write_end, framing.encode_reply(reply))
            framing.write_all(write_end, framing.PLAIN_BYTES)

        writer = threading.Thread(target=write)
        writer.start()
        reader, out = framing.FrameReader(), []  # type: ignore[var-annotated]
        deadline = time.monotonic() + 60
        while len(out) < 3 and time.monotonic() < deadline:  # what is there, as the pool reads
            assert reader.read(read_end, out)
        writer.join(timeout=30)
        check(out[0], arrays)
        check(out[1], arrays)
        assert out[2] is None and not reader.partial
        assert not np.shares_memory(out[0].values[4]["frames"], out[1].values[4]["frames"])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_rollouts_of_frames_through_the_pipes_are_the_serial_backends() -> None:
    got: dict[str, Any] = {}
    for backend in ("serial", "process"):
        with envfleet.make(FramesEnv, 4, backend=backend, num_workers=2, seed=0) as pool:
            pool.reset(seed=0)
            policy = envfleet.RandomPolicy(pool.single_action_space, seed=3)
            got[backend] = [pool.rollout(policy, 100) for _ in range(2)]  # 2.4 MB a part
    for want, have in zip(got["serial"], got["process"], strict=True):
        for name in ("observations", "actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(have, name), getattr(want, name), err_msg=name)
            assert getattr(have, name).dtype == getattr(want, name).dtype
        np.testing.assert_array_equal(have.final_observations, want.final_observations)


OBS = spaces.Box(-1e6, 1e6, shape=(32, 32), dtype=np.float32)  # 4 KB an env: read in place
ACTS = spaces.Discrete(4)
STEPS, IDS = 20, (2, 3)


def part_of(ids: tuple[int, ...], steps: int) -> Sampled:
    """A worker's part of a rollout, its values made of the steps and env ids."""
    grid = np.add.outer(np.arange(steps) * 100, np.array(ids))
    return Sampled(
        env_ids=ids,
        steps=steps,
        observations=(grid[..., None, None] * np.ones((32, 32))).astype(np.float32),
        actions=(grid % 4).astype(np.int64),
        rewards=grid / 2.0,
        terminations=grid % 3 == 0,
        truncations=grid % 5 == 0,
        infos={1: {ids[0]: {"x": ids[0]}}},
        reset_infos={0: {ids[-1]: {"seed": 7}}},
        final_observations=np.ones((len(ids), 32, 32), np.float32),
    )


RECORDED = ("observations", "actions", "rewards", "terminations", "truncations")


def check_part(got: Any, want: Sampled, out: Out, into: Sampled | None) -> None:
    assert isinstance(got, Reply) and got.values is not None
    part = got.values[IDS[0]]
    assert isinstance(part, Sampled) and (part.env_ids, part.steps) == (IDS, STEPS)
    for name in RECORDED:
        np.testing.assert_array_equal(getattr(part, name), getattr(want, name), err_msg=name)
        assert getattr(part, name).dtype == getattr(want, name).dtype, name
    assert (part.infos, part.reset_infos) == (want.infos, want.reset_infos)
    np.testing.assert_array_equal(part.final_observations, want.final_observations)
    assert np.shares_memory(part.observations, out.observations) is (into is not None)
    assert not np.shares_memory(part.rewards, out.rewards)  # 16 bytes a step: copied in
    if into is not None:  # the rollout's columns: the observations there, the rest copied
        out.add(part, slice(IDS[0], IDS[-1] + 1), into)
        for name in RECORDED:
            column = getattr(out, name)[:, IDS[0] : IDS[-1] + 1]
            np.testing.assert_array_equal(column, getattr(want, name), err_msg=name)


def out_and_reader(given: bool) -> tuple[Out, framing.FrameReader, Sampled | None]:
    """A rollout's arrays over 5 envs, and a reader given their columns of ``IDS`` if
    ``given``."""
    out = Out(OBS, ACTS, STEPS, np.arange(5, dtype=np.int64))
    reader = framing.FrameReader()
    into = out.into(IDS) if given else None
    if into is not None:
        reader.landing[IDS] = into
    return out, reader, into


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("piece", [1, 3000, 1 << 16, 1 << 30])
def test_a_rollouts_part_is_read_into_the_columns_given_however_its_bytes_are_cut(
    piece: int, given: bool
) -> None:
    """A part's recorded arrays after its reply, read into the rollout's columns the pool gave
    for its envs where a step's block is large (observations), into arrays of their own where
    not (the rest) or where none were given; a plain reply and a frame right behind."""
    want = part_of(IDS, STEPS)
    encoded = framing.encode_reply(Reply(env_ids=IDS, values={IDS[0]: part_of(IDS, STEPS)}))
    assert isinstance(encoded, list) and encoded[0][0] == landing.PARTS
    assert len(encoded[1]) < 16384  # the pickle: final observations (8 KB), no recorded array
    small = wire(Reply(env_ids=(1,), infos={1: {"x": 1}}))
    stream = b"".join(bytes(p) for p in encoded) + framing.PLAIN_BYTES + small
    out, reader, into = out_and_reader(given)
    got: list[Any] = []
    starts = list(range(0, 300)) + list(range(300, len(stream), piece)) if piece == 1 else None
    for start in starts or range(0, len(stream), piece):
        step = 1 if piece == 1 and start < 300 else piece
        reader.feed(stream[start : start + step], got)
    assert len(got) == 3 and not reader.partial and not reader.landing
    check_part(got[0], want, out, into)
    assert got[1] is None and got[2].infos == {1: {"x": 1}}


@pytest.mark.parametrize("given", [True, False])
def test_a_rollouts_part_is_read_from_the_pipe_into_the_columns(given: bool) -> None:
    want = part_of(IDS, STEPS)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:

        def write() -> None:
            reply = Reply(env_ids=IDS, values={IDS[0]: part_of(IDS, STEPS)})
            framing.write_all(write_end, framing.encode_reply(reply))

        writer = threading.Thread(target=write)
        writer.start()
        out, reader, into = out_and_reader(given)
        got: list[Any] = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            assert reader.read(read_end, got)
        writer.join(timeout=30)
        check_part(got[0], want, out, into)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_error", ["restart", "raise"])
def test_a_worker_that_dies_halfway_through_its_part_is_lost_and_named(
    on_error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while writing its part (the pool not reading: its pipe full, the rest never
    comes): under ``raise`` the wait names the worker; under ``restart`` its part runs again on
    the rebuilt worker, its envs flagged as restarted at the first step, and the other
    worker's part is the serial backend's, bit for bit. (Parts go down the pipe here, as where
    the pool's memory is not shared: tests/test_shared_records.py kills a worker recording in
    place.)"""
    monkeypatch.setattr(shared_weights, "record_ref", lambda arrays: None)
    make: dict[str, Any] = {"num_workers": 2, "seed": 0, "on_error": on_error}
    steps = 200  # 2 envs x 200 x 12 KB a worker: 4.9 MB, past a widened pipe
    with envfleet.make(FramesEnv, 4, backend="serial", **make) as serial:
        serial.reset(seed=0)
        want = serial.rollout(envfleet.RandomPolicy(serial.single_action_space, seed=2), steps)
    with envfleet.make(FramesEnv, 4, backend="process", **make) as pool:
        pool.reset(seed=0)
        pool.rollout_async(envfleet.RandomPolicy(pool.single_action_space, seed=2), steps)
        slot = pool._transport._workers[0]  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        while _pipe_holds(slot.reply_fd) < landing.PIPE_SIZE // 2:  # writing, and blocked
            assert time.monotonic() < deadline, "the worker never filled its pipe"
            time.sleep(0.01)
        os.kill(slot.proc.pid, signal.SIGKILL)
        if on_error == "raise":
            with pytest.raises(WorkerDiedError) as caught:
                pool.rollout_wait()
            assert caught.value.worker == 0
            return
        got = pool.rollout_wait()
        assert got.env_ids.tolist() == [0, 1, 2, 3]
        np.testing.assert_array_equal(got.truncations[0], [True, True, False, False])
        np.testing.assert_array_equal(got.infos[0]["_envfleet/restarted"], [1, 1, 0, 0])
        for name in ("observations", "actions", "rewards", "terminations", "truncations"):
            have, ref = getattr(got, name)[:, 2:], getattr(want, name)[:, 2:]
            np.testing.assert_array_equal(have, ref, err_msg=name)
        assert pool.stats().restarts == 2


def _pipe_holds(fd: int) -> int:
    """The bytes waiting in the pipe ``fd`` (``FIONREAD``)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
