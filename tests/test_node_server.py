"""A node agent's loop (:class:`~envfleet.backends.nodes.server.NodeServer`) without Ray.

The agent's local process pool is replaced by a scripted stand-in whose workers reply when the
test says so, and the pool's side is a :class:`~envfleet.backends.nodes.link.NodeLink` on the
other end of a socket pair: what the agent sends, and when, is read as the pool reads it. The
agent's time limits are set out of reach, so an answer goes only because a round is all in.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from envfleet.backends.contract.base import Replies, WorkerLost
from envfleet.backends.nodes import server as node_server
from envfleet.backends.nodes import wire as node_wire
from envfleet.backends.nodes.link import NodeLink
from envfleet.backends.nodes.server import NodeServer
from envfleet.buffers import Batch
from envfleet.errors import Phase
from envfleet.info_columns import info_columns
from envfleet.protocol import Command, EnvFailure, Reply, Sample, Step
from envfleet.rollout_loop import Sampled
from tests.test_infos import assert_same, gymnasium_infos

WORKERS, PER_WORKER = 4, 2
ENVS = WORKERS * PER_WORKER
OBS = spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
ACTIONS = spaces.Discrete(2)


class ScriptedWorkers:
    """Stands for the agent's process pool: a worker replies once :meth:`finish` says so,
    having written its envs' rows into the node's batch. :meth:`wait` returns as the process
    backend's does within a slice that never ends: once ``want`` replies are in."""

    def __init__(self) -> None:
        self.batch = Batch.local(OBS, ACTIONS, ENVS)
        self.submitted: list[tuple[int, Command]] = []
        self.done: Replies = []
        self.whole_rounds = 0  # rounds handed over whole (submit_all: in the wake order)
        self.at_once: set[int] = set()  # workers that finish as soon as a whole round is out
        self.read_in_order = 0  # plain replies read one worker at a time (read_plain)

    def watch(self, fd: int) -> None:
        pass

    def submit(self, worker: int, command: Command) -> None:
        self.submitted.append((worker, command))

    def submit_all(self, commands: list[Command]) -> None:
        self.whole_rounds += 1
        for worker, command in enumerate(commands):
            self.submit(worker, command)
        self.finish(*sorted(self.at_once))

    def finish(self, *workers: int, reply: Reply | None = None) -> None:
        for worker in workers:
            (command,) = [c for w, c in self.submitted if w == worker]
            self.submitted.remove((worker, command))
            for i in command.env_ids:  # type: ignore[union-attr]
                step = int(self.batch.actions[i])
                self.batch.observations[i] = i + step
                self.batch.rewards[i] = 10 * i + step
            self.done.append((worker, reply))

    def wait(self, timeout: float | None, want: int = 1, linger: float | None = None) -> Replies:
        if len(self.done) < want:
            return []
        done, self.done = self.done, []
        return done

    def read_plain(self, worker: int, timeout: float) -> Replies | None:
        mine = [done for done in self.done if done[0] == worker]
        self.done = [done for done in self.done if done[0] != worker]
        if mine == [(worker, None)]:
            self.read_in_order += 1
            return None
        return mine


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
    link: NodeLink,
    server: NodeServer,
    pool: Batch,
    workers: list[int],
    action: int,
    commands: list[Command] | None = None,
) -> list[Command]:
    """The pool's round: a step of ``workers``' envs with ``action`` (``commands``: the same
    command objects again, as a sync step sends them)."""
    if commands is None:
        commands = [Step(tuple(range(w * PER_WORKER, (w + 1) * PER_WORKER))) for w in workers]
    for w in workers:
        pool.actions[w * PER_WORKER : (w + 1) * PER_WORKER] = action
    parts = link.round(workers, commands, [pool.actions])
    assert parts is not None
    assert server.handle(b"".join(parts))
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


def test_two_halves_in_flight_each_answered_as_soon_as_it_is_in(
    pair: tuple[Connection, Connection],
) -> None:
    """Double buffering on one node: each half of its envs sent apart (a round each), and the
    half that is in goes while the other still steps."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    send_steps(link, server, pool, [0, 1], 1)
    send_steps(link, server, pool, [2, 3], 0)
    np.testing.assert_array_equal(workers.batch.actions, [1, 1, 1, 1, 0, 0, 0, 0])
    workers.finish(1)
    server.collect()
    assert answers(link, pool) == []  # half of the first half
    workers.finish(0)
    server.collect()
    assert answers(link, pool) == [[0, 1]]  # while workers 2 and 3 step
    np.testing.assert_array_equal(pool.observations[:4, 0], [1, 2, 3, 4])
    np.testing.assert_array_equal(pool.rewards[:4], [1, 11, 21, 31])
    assert not pool.rewards[4:].any()
    send_steps(link, server, pool, [0, 1], 0)  # that half's next step, the other in flight
    workers.finish(3, 2)
    server.collect()
    assert answers(link, pool) == [[2, 3]]
    workers.finish(0, 1)
    server.collect()
    assert answers(link, pool) == [[0, 1]]
    np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS))
    assert server.owed == 0 and not server.left


def test_what_is_in_goes_with_a_round_that_completes_and_never_twice(
    pair: tuple[Connection, Connection],
) -> None:
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    send_steps(link, server, pool, [0, 1], 1)
    send_steps(link, server, pool, [2, 3], 1)
    workers.finish(3, 1)  # one of each round
    server.collect()
    assert answers(link, pool) == []
    workers.finish(2)  # completes the second round: worker 1's reply goes with it
    server.collect()
    assert answers(link, pool) == [[1, 2, 3]]
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
    commands = None
    for step in range(2):  # the second: the same round again (one byte and the actions)
        commands = send_steps(link, server, pool, list(range(WORKERS)), step, commands)
        workers.finish(0, 1)
        server.collect()
        assert answers(link, pool) == []
        workers.finish(2, 3)
        server.collect()
        assert answers(link, pool) == [[0, 1, 2, 3]]
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)
    assert server.hold and link.last is commands
    assert workers.whole_rounds == 2  # each went out in the wake order (submit_all)


def test_a_repeated_sync_step_is_read_worker_by_worker_and_answered_the_same(
    pair: tuple[Connection, Connection],
) -> None:
    """Once a sync step of every worker was answered plainly, its repeats are the agent's hot
    path: the replies read in the workers' order with no bookkeeping, the same answer."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    commands = None
    for step in range(4):
        workers.at_once = set(range(WORKERS)) if step else set()  # the first: the general way
        commands = send_steps(link, server, pool, list(range(WORKERS)), step, commands)
        if not step:
            workers.finish(*range(WORKERS))
            server.collect()
        assert answers(link, pool) == [[0, 1, 2, 3]]
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)
        assert server.owed == 0 and not server.left and not server.held
        assert not any(server.inflight)
    assert workers.read_in_order == 3 * WORKERS and workers.whole_rounds == 4


def test_a_sync_step_slower_than_the_in_order_limit_repeats_the_general_way(
    pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envs whose rounds take longer than IN_ORDER_LIMIT would wait it out on the first worker
    every step: their repeats go the general way, answered as before."""
    monkeypatch.setattr(node_server, "IN_ORDER_LIMIT", 0.0)
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    commands = None
    for step in range(3):
        commands = send_steps(link, server, pool, list(range(WORKERS)), step, commands)
        workers.finish(*range(WORKERS))
        server.collect()
        assert answers(link, pool) == [[0, 1, 2, 3]]
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)
    assert workers.read_in_order == 0 and server.whole_plain is None


def failure(ids: tuple[int, ...]) -> Reply:
    """A reply whose first env failed."""
    return Reply(env_ids=ids, failures=(EnvFailure.capture(ids[0], Phase.STEP, ValueError()),))


@pytest.mark.parametrize("late", range(WORKERS))
@pytest.mark.parametrize("how", ["late", "infos", "fails", "lost"])
def test_a_repeat_whose_worker_is_late_says_more_or_is_lost_goes_on_the_general_way(
    pair: tuple[Connection, Connection], late: int, how: str
) -> None:
    """Read worker by worker, a repeat stops at the first worker that is not in, answers
    more than a plain reply or is lost: the workers read before it are held, the rest taken
    as any round's replies are; a failure or a lost worker goes at once, with what is in,
    and the rest in their own answer; a late worker's round, or one with dict infos, is
    answered once, whole."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    everyone = list(range(WORKERS))
    commands = send_steps(link, server, pool, everyone, 0)
    workers.finish(*everyone)
    server.collect()
    assert answers(link, pool) == [everyone]
    ids = tuple(range(late * PER_WORKER, (late + 1) * PER_WORKER))
    workers.at_once = set(range(late))  # those before it finish at once, the rest later
    if how == "fails":
        workers.done.append((late, failure(ids)))
    elif how == "infos":
        workers.done.append((late, Reply(env_ids=ids, infos={ids[0]: {"final": (1, 2)}})))
    elif how == "lost":
        workers.done.append((late, WorkerLost(-9, "killed")))
    send_steps(link, server, pool, everyone, 1, commands)
    assert workers.read_in_order == late
    if how in ("late", "infos"):
        if how == "late" or late < WORKERS - 1:
            assert answers(link, pool) == [] and server.owed == WORKERS - late - (how == "infos")
            workers.finish(*range(late + (how == "infos"), WORKERS))
            server.collect()
        got = answers(link, pool)
        assert got == [everyone]  # one answer, whole, with the infos
        if how == "late":
            np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + 1)
    else:
        first = answers(link, pool)
        assert first == [list(range(late + 1))]  # at once: what is in and the bad news
        rest = list(range(late + 1, WORKERS))
        workers.finish(*rest)
        server.collect()
        assert answers(link, pool) == ([rest] if rest else [])
    assert server.owed == 0 and not server.left and not server.held and not workers.done


def test_a_round_of_every_worker_out_of_order_goes_to_the_workers_it_names(
    pair: tuple[Connection, Connection],
) -> None:
    """An async round may name every worker, in another order: its commands go one by one to
    the workers named (not in the workers' order), the first time and repeated."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    order = [2, 3, 0, 1]
    commands = None
    for step in range(2):  # the second: a repeat (one byte)
        commands = send_steps(link, server, pool, order, step, commands)
        assert [(w, c.env_ids) for w, c in workers.submitted] == [  # type: ignore[attr-defined]
            (w, tuple(range(w * PER_WORKER, (w + 1) * PER_WORKER))) for w in order
        ]
        workers.finish(*order)
        server.collect()
        assert answers(link, pool) == [[0, 1, 2, 3]]
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)
    assert workers.whole_rounds == 0


def test_infos_the_workers_sent_as_columns_go_on_as_columns(
    pair: tuple[Connection, Connection],
) -> None:
    """Columns from the workers go with the round's answer as they came: an "I" answer when
    every reply is plain otherwise, beside a worker's dict infos in a general one; the pool
    lays them into its table and gets Gymnasium's infos from the two together."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    infos: list[dict[str, Any] | None] = [
        {"lives": 3 - i % 2, "frame": np.int32(4 * i)} for i in range(ENVS)
    ]
    infos[6] = {"x": 0.5}  # worker 3: another layout
    infos[7] = None
    commands = None
    for step, odd in enumerate([None, 2]):  # the second step: worker 2 sends dicts
        if odd is not None:
            infos[2 * odd] = {"pos": np.arange(2) + step, "lives": 1}
        commands = send_steps(link, server, pool, list(range(WORKERS)), step, commands)
        for w in range(WORKERS):
            ids = range(w * PER_WORKER, (w + 1) * PER_WORKER)
            sent = {i: info for i in ids if (info := infos[i])}
            columns = info_columns(sent)
            if w == odd:
                assert columns is None
                workers.finish(w, reply=Reply(env_ids=tuple(ids), infos=sent))
            else:
                assert columns is not None
                server.columns.append(columns)
                workers.finish(w)
        server.collect()
        assert link.conn is not None
        data = link.conn.recv_bytes()
        assert data[:1] == (node_wire.INFOS if odd is None else node_wire.GENERAL)
        fields = [pool.observations, pool.rewards, pool.terminations, pool.truncations]
        got = link.take(data, fields, pool, OBS, np.zeros(ENVS, np.int64))
        assert [worker for worker, _ in got] == list(range(WORKERS)) and not server.columns
        replies = [reply for _, reply in got if isinstance(reply, Reply)]
        dicts = {i: info for reply in replies for i, info in reply.infos.items()}
        pairs = [(dicts.get(i), i) for i in range(ENVS)]
        assert_same(pool.infos.take(np.arange(ENVS), None, ENVS, pairs), gymnasium_infos(infos))
        np.testing.assert_array_equal(pool.rewards, 10 * np.arange(ENVS) + step)


def test_a_rollouts_large_arrays_travel_out_of_band_and_come_back_whole_and_writable(
    pair: tuple[Connection, Connection],
) -> None:
    """In the answer to a rollout, large arrays travel after the pickle, 16-byte aligned, and
    come back equal, writable and in their dtypes, with the round's rows after them intact;
    the pool's arrays are views of the message it read (no copy out of a pickle), or of one
    copy of it when the message is read-only bytes. The same values in the answer to any
    other command travel inside the pickle: a value the caller keeps (a frame of ``call``)
    must not keep the whole message alive."""
    server, workers, link = setup(pair)
    pool = Batch.local(OBS, ACTIONS, ENVS)
    values = {
        "big": np.arange(node_wire.OUT_OF_BAND // 8 + 1, dtype=np.float64),  # odd length
        "just": np.ones(node_wire.OUT_OF_BAND, np.uint8),
        "small": np.arange(7, dtype=np.int32),
        "strided": np.arange(node_wire.OUT_OF_BAND, dtype=np.int16)[::2],  # inside
        "nested": [{"frames": np.full((1, 300, 300), 7, np.uint8)}],
    }
    ids = [tuple(range(w * PER_WORKER, (w + 1) * PER_WORKER)) for w in range(WORKERS)]
    for rollout in (True, False):
        # worker 0 answers a rollout (no rows: they are in its values) or a step; the
        # others' step rows travel after its values
        commands: list[Command] = [Step(i, actions={}) for i in ids]
        if rollout:
            commands[0] = Sample(ids[0], 3, b"policy")
        assert server.handle(b"".join(link.round(range(WORKERS), commands, []) or []))
        workers.finish(0, reply=Reply(env_ids=ids[0], values=values))
        workers.finish(*range(1, WORKERS))
        conn = link.conn
        assert conn is not None
        read: list[bytes] = []  # more than the socket holds: read while the agent writes
        reader = threading.Thread(target=lambda: read.append(conn.recv_bytes()))  # noqa: B023
        reader.start()
        server.collect()
        reader.join(timeout=60)
        (data,) = read
        assert data[:1] == node_wire.GENERAL and len(data) > 4 * node_wire.OUT_OF_BAND
        for message in (data, bytearray(data)):
            fields = [pool.observations, pool.rewards, pool.terminations, pool.truncations]
            pool.rewards[:] = -1
            if message is not data:  # the same answer read again
                for w, command in enumerate(commands):
                    link.inflight[w].append(command)
            got = link.take(message, fields, pool, OBS, np.zeros(ENVS, np.int64))
            reply = got[0][1]
            assert isinstance(reply, Reply) and reply.values is not None
            back = reply.values
            for key in ("big", "just", "small", "strided"):
                np.testing.assert_array_equal(back[key], values[key], err_msg=key)
                assert back[key].dtype == values[key].dtype and back[key].flags.writeable, key
            frames = back["nested"][0]["frames"]
            np.testing.assert_array_equal(frames, values["nested"][0]["frames"])
            assert frames.flags.writeable and frames.flags.aligned and back["big"].flags.aligned
            want = 10.0 * np.arange(ENVS)
            if rollout:
                want[list(ids[0])] = -1
            np.testing.assert_array_equal(pool.rewards, want)
            if isinstance(message, bytearray):  # views of what was read, or not
                read_bytes = np.frombuffer(message, np.uint8)
                for array in (back["big"], back["just"], frames):
                    assert np.shares_memory(array, read_bytes) is rollout
                assert not np.shares_memory(back["small"], read_bytes)


def sampled(ids: tuple[int, ...], steps: int, **changes: Any) -> Sampled:
    """A worker's part of a rollout over ``ids``, its values made of the env ids."""
    grid = np.add.outer(np.arange(steps), np.array(ids))  # (steps, envs): 100 * t + i
    part = Sampled(
        env_ids=ids,
        steps=steps,
        observations={
            "a": (grid[..., None] * np.ones(3)).astype(np.float32),
            "b": (grid.astype(np.int8),),
        },
        actions=grid.astype(np.int64),
        rewards=grid.astype(np.float64) / 2,
        terminations=grid % 3 == 0,
        truncations=grid % 5 == 0,
        infos={1: {ids[0]: {"x": ids[0]}}, 2: {ids[-1]: {"y": 1}}},
        reset_infos={0: {ids[-1]: {"seed": ids[-1]}}},
        final_observations={
            "a": np.array(ids, np.float32)[:, None] * np.ones(3, np.float32),
            "b": (np.array(ids, np.int8),),
        },
    )
    return dataclasses.replace(part, **changes)


@pytest.mark.parametrize("size", [100, node_wire.OUT_OF_BAND])
def test_a_versions_frame_goes_to_a_node_once_as_it_is(size: int) -> None:
    """A round whose rollout commands carry a large frame (a version's weights, a large
    policy) sends its bytes once, from the frame itself, after the pickle (SUBMIT_APART), not
    copied into each node's pickle; the agent reads one ``bytes`` the commands share, and
    what follows the commands (a step's actions) where it was. A small frame goes inside."""
    frame = bytes(range(256)) * (size // 256 + 1)
    policy = b"p" * (2 * size)
    body: list[tuple[int, Command]] = [
        (0, Sample((0, 1), 5, policy, version=3, code="c", weights=frame)),
        (1, Sample((2, 3), 5, None, version=3, code="c", weights=frame)),
        (2, Step((4, 5))),
    ]
    parts = node_wire.submit(body)
    message = b"".join(parts) + b"rows"
    large = size >= node_wire.OUT_OF_BAND
    assert message[:1] == (node_wire.SUBMIT_APART if large else node_wire.SUBMIT)
    assert (len(message) < len(frame) + len(policy) + 1024) and len(message) > len(frame)
    sent = [p for p in parts if isinstance(p, memoryview) and p.obj in (frame, policy)]
    assert len(sent) == (2 if large else 0)  # the frames' own memory: no copy
    got, at = node_wire.read_submit(memoryview(message))
    assert message[at:] == b"rows"
    assert [(w, type(c), vars(c)) for w, c in got] == [(w, type(c), vars(c)) for w, c in body]
    first, second = got[0][1], got[1][1]
    assert isinstance(first, Sample) and isinstance(second, Sample)
    assert type(first.weights) is bytes and first.weights is second.weights
    assert type(first.policy) is bytes and second.policy is None
