"""A node agent's loop (:class:`~envfleet.backends.node_server.NodeServer`) without Ray.

The agent's local process pool is replaced by a scripted stand-in whose workers reply when the
test says so, and the pool's side is a :class:`~envfleet.backends.node_link.NodeLink` on the
other end of a socket pair: what the agent sends, and when, is read as the pool reads it. The
agent's time limits are set out of reach, so an answer goes only because a round is all in.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest
from gymnasium import spaces

from envfleet.backends import node_server
from envfleet.backends.base import Replies
from envfleet.backends.node_link import NodeLink
from envfleet.backends.node_server import NodeServer
from envfleet.buffers import Batch
from envfleet.protocol import Command, Step

WORKERS, PER_WORKER = 4, 2
ENVS = WORKERS * PER_WORKER
OBS = spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
ACTIONS = spaces.Discrete(2)


class ScriptedWorkers:
    """Stands for the agent's process pool: a worker replies once :meth:`finish` says so,
    having written its envs' rows (the env index, as every value) into the node's batch."""

    def __init__(self) -> None:
        self.batch = Batch.local(OBS, ACTIONS, ENVS)
        self.submitted: list[tuple[int, Command]] = []
        self.done: Replies = []
        self.waits: list[int] = []

    def submit(self, worker: int, command: Command) -> None:
        self.submitted.append((worker, command))

    def finish(self, *workers: int) -> None:
        for worker in workers:
            (command,) = [c for w, c in self.submitted if w == worker]
            self.submitted.remove((worker, command))
            for i in command.env_ids:  # type: ignore[union-attr]
                step = int(self.batch.actions[i])
                self.batch.observations[i] = i + step
                self.batch.rewards[i] = 10 * i + step
            self.done.append((worker, None))

    def wait(self, timeout: float | None, want: int = 1) -> Replies:
        self.waits.append(want)
        done, self.done = self.done, []
        return done


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Connection, Connection]]:
    monkeypatch.setattr(node_server, "LOCAL_SLICE", 1e9)
    monkeypatch.setattr(node_server, "HOLD_LIMIT", 1e9)
    a, b = socket.socketpair()
    pool, agent = Connection(a.detach()), Connection(b.detach())
    yield pool, agent
    pool.close()
    agent.close()


def setup(pair: tuple[Connection, Connection]) -> tuple[NodeServer, ScriptedWorkers, NodeLink]:
    pool_conn, agent_conn = pair
    workers = ScriptedWorkers()
    server = NodeServer(workers, agent_conn, WORKERS, None)  # type: ignore[arg-type]
    link = NodeLink(0, "node", list(range(WORKERS)), conn=pool_conn, alive=True)
    link.started()
    return server, workers, link


def send_steps(
    link: NodeLink, server: NodeServer, pool: Batch, actions: np.ndarray, halves: bool
) -> list[Command]:
    """The pool's round: a step of every worker's envs, with ``actions``."""
    pool.actions[:] = actions
    commands: list[Command] = [
        Step(tuple(range(w * PER_WORKER, (w + 1) * PER_WORKER))) for w in range(WORKERS)
    ]
    message = link.round(range(WORKERS), commands, [pool.actions], halves)
    assert message is not None
    assert server.handle(message)
    return commands


def answers(link: NodeLink, pool: Batch) -> list[list[int]]:
    """Every answer the agent sent so far: the pool's workers each answers (rows into
    ``pool``)."""
    assert link.conn is not None
    out = []
    while link.conn.poll(0):
        data = link.conn.recv_bytes()
        fields = [pool.observations, pool.rewards, pool.terminations, pool.truncations]
        got = link.take(data, fields, pool, OBS, np.zeros(ENVS, np.int64))
        out.append([worker for worker, _ in got])
    return out


def test_each_half_of_an_async_round_is_answered_as_soon_as_it_is_in(
    pair: tuple[Connection, Connection],
) -> None:
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    send_steps(link, server, pool, np.arange(ENVS) % 2, halves=True)
    np.testing.assert_array_equal(workers.batch.actions, np.arange(ENVS) % 2)
    workers.finish(1)
    server.collect()
    assert answers(link, pool) == []  # half of the first half
    workers.finish(0)
    server.collect()
    # The first half (workers 0 and 1) goes while the second still steps.
    assert answers(link, pool) == [[0, 1]]
    np.testing.assert_array_equal(pool.observations[:4, 0], [0, 2, 2, 4])
    np.testing.assert_array_equal(pool.rewards[:4], [0, 11, 20, 31])
    assert not pool.rewards[4:].any()
    workers.finish(3, 2)
    server.collect()
    assert answers(link, pool) == [[2, 3]]
    np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + np.arange(ENVS) % 2)
    assert server.owed == 0 and not server.left


def test_halves_of_two_rounds_go_each_when_in_whatever_the_other_owes(
    pair: tuple[Connection, Connection],
) -> None:
    """Two async rounds in flight (two halves of the envs sent apart): the later one's half is
    answered while the earlier one still owes, and a half is never answered twice."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    pool.actions[:] = 1
    first: list[Command] = [Step((0, 1)), Step((2, 3))]
    message = link.round([0, 1], first, [pool.actions], halves=True)
    assert message is not None and server.handle(message)
    second: list[Command] = [Step((4, 5)), Step((6, 7))]
    message = link.round([2, 3], second, [pool.actions], halves=True)
    assert message is not None and server.handle(message)
    workers.finish(2)  # the second round's first half
    server.collect()
    assert answers(link, pool) == [[2]]
    workers.finish(3, 1)
    server.collect()
    assert answers(link, pool) == [[1, 3]]
    assert server.owed == 1
    workers.finish(0)
    server.collect()
    assert answers(link, pool) == [[0]]
    np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + 1)


def test_a_sync_step_is_answered_once_every_worker_is_in(
    pair: tuple[Connection, Connection],
) -> None:
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    for step in range(2):  # the second is the same round again (one byte and the actions)
        send_steps(link, server, pool, np.full(ENVS, step), halves=False)
        workers.finish(0, 1)
        server.collect()
        assert answers(link, pool) == []
        workers.finish(2, 3)
        server.collect()
        assert answers(link, pool) == [[0, 1, 2, 3]]
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)
    assert server.hold


def test_the_agent_waits_for_no_more_replies_than_the_nearest_round_needs(
    pair: tuple[Connection, Connection],
) -> None:
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    send_steps(link, server, pool, np.zeros(ENVS, np.int64), halves=True)
    server.collect()
    workers.finish(0, 1, 2)
    server.collect()
    server.collect()
    assert workers.waits == [2, 2, 1]  # a half of two workers; then the last one
    workers.finish(3)
    server.collect()
    send_steps(link, server, pool, np.zeros(ENVS, np.int64), halves=False)
    server.collect()
    assert workers.waits[-1] == WORKERS  # a sync step: every worker
