"""The process backend's wire (:mod:`envfleet.backends.contract.framing`, served by
:func:`~envfleet.backends.contract.channel.serve_pipes`): one byte for a
repeated command and for a plain reply, frames for the rest. Its edges: a reply larger than a
pipe's buffer, a reply that cannot be pickled, a worker that dies halfway through a reply, and
the end of the command pipe when the pool goes."""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium import spaces

import envfleet
from envfleet.backends.contract import channel, framing
from envfleet.errors import EnvError, WorkerDiedError
from envfleet.protocol import Reply, Step

BIG = 1 << 20  # bytes: many times a pipe's buffer (64 KiB on Linux)


class BigInfoEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Action 1: a ``BIG``-byte info; action 2: an info that cannot be pickled; 0: no info."""

    metadata: dict[str, Any] = {}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 1000, shape=(1,), dtype=np.int64)
        self.action_space = spaces.Discrete(3)
        self.count = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.count = 0
        return np.array([0], dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.count += 1
        info: dict[str, Any] = {}
        if action == 1:
            info = {"blob": bytes([self.count % 256]) * BIG}
        elif action == 2:
            info = {"lock": threading.Lock()}
        return np.array([self.count], dtype=np.int64), 1.0, False, False, info


@pytest.fixture
def pool() -> Any:
    pool = envfleet.make(BigInfoEnv, 4, backend="process", num_workers=2)
    pool.reset(seed=0)
    yield pool
    pool.close()


def test_replies_larger_than_a_pipe_buffer_arrive_whole(pool: Any) -> None:
    # Every worker writes a reply of several buffers at once; then plain replies again.
    for _ in range(3):
        obs, rewards, _, _, infos = pool.step(np.array([1, 0, 1, 1]))
        assert obs[:, 0].tolist() == [pool_count(pool, i) for i in range(4)]
        assert infos["_blob"].tolist() == [True, False, True, True]
        for i in (0, 2, 3):
            blob = infos["blob"][i]
            assert len(blob) == BIG and blob == bytes([blob[0]]) * BIG
        obs2, *_ = pool.step(np.zeros(4, dtype=np.int64))
        assert (obs2 == obs + 1).all()
        assert rewards.tolist() == [1.0] * 4


def pool_count(pool: Any, i: int) -> int:
    return int(pool.get_attr("count")[i])


def test_a_reply_that_cannot_be_pickled_fails_its_env(pool: Any) -> None:
    with pytest.raises(EnvError, match="could not be pickled") as caught:
        pool.step(np.array([0, 0, 2, 0]))
    assert caught.value.env_index == 2
    assert isinstance(caught.value.__cause__, TypeError)


@pytest.mark.timeout(60)
def test_a_worker_that_dies_halfway_through_a_reply_is_reported_lost() -> None:
    pool = envfleet.make(BigInfoEnv, 2, backend="process", num_workers=2)
    try:
        pool.reset(seed=0)
        pool.send(np.array([1, 0]))  # worker 0 writes 1 MiB; nobody reads it yet
        transport = pool._transport
        pid = transport.pids()[0]
        deadline = time.monotonic() + 20
        # Blocked in its write: the pipe holds a part of the reply, the rest never comes.
        while psutil.Process(pid).status() != psutil.STATUS_SLEEPING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as caught:
            pool.recv()
        assert caught.value.worker == 0
    finally:
        pool.close()


class _Group:
    """A stand-in group that records what it served and whether it was closed."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.served = 0
        self.closed = threading.Event()

    def step(self, env_ids: Any, actions: Any = None) -> Reply:
        self.served += 1
        return self.reply

    def close(self) -> Reply:
        self.closed.set()
        return Reply()


def _serve_in_thread(group: _Group) -> tuple[threading.Thread, int, int]:
    command_r, command_w = os.pipe()
    reply_r, reply_w = os.pipe()

    def run() -> None:
        try:
            channel.serve_pipes(group, command_r, reply_w)  # type: ignore[arg-type]
        finally:
            os.close(command_r)
            os.close(reply_w)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, command_w, reply_r


def _read_replies(fd: int, count: int) -> list[Reply | None]:
    reader, out = framing.FrameReader(), []  # type: ignore[var-annotated]
    while len(out) < count:
        data = os.read(fd, 4096)  # small reads: frames arrive in pieces
        assert data, "EOF before the replies"
        reader.feed(data, out)
    assert not reader.partial
    return out


@pytest.mark.timeout(30)
def test_repeat_runs_the_last_command_and_eof_closes_the_group() -> None:
    big = Reply(env_ids=(0,), infos={0: {"x": b"y" * 100_000}})
    group = _Group(Reply(env_ids=(0,)))
    thread, command_w, reply_r = _serve_in_thread(group)
    try:
        command = Step((0,))
        framing.write_all(command_w, framing.frame(ForkingPickler.dumps(command)))
        framing.write_all(command_w, framing.REPEAT_BYTES * 3)
        assert _read_replies(reply_r, 4) == [None] * 4  # plain: one byte each
        group.reply = big
        framing.write_all(command_w, framing.REPEAT_BYTES)
        (reply,) = _read_replies(reply_r, 1)
        assert isinstance(reply, Reply) and reply.infos == big.infos
        assert group.served == 5
        os.close(command_w)  # the pool goes away: the worker sees EOF, closes its envs
        command_w = -1
        assert group.closed.wait(10)
        thread.join(10)
        assert not thread.is_alive()
    finally:
        if command_w >= 0:
            os.close(command_w)
        os.close(reply_r)


def test_a_frame_cut_short_stays_partial() -> None:
    body = framing.encode_reply(Reply(env_ids=(3,), infos={3: {"k": "v"}}))
    assert body[0] == framing.FRAME and framing.encode_reply(Reply(env_ids=(3,))) == b"\0"
    reader, out = framing.FrameReader(), []  # type: ignore[var-annotated]
    reader.feed(b"\0" + body[:-1], out)
    assert out == [None] and reader.partial
    reader.feed(body[-1:] + b"\0", out)
    assert len(out) == 3 and out[1].infos == {3: {"k": "v"}} and out[2] is None
    assert not reader.partial
