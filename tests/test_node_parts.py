"""A rollout's parts between a node agent and the pool
(:mod:`envfleet.backends.contract.raw_parts`): the agent's loop
(:class:`~envfleet.backends.nodes.server.NodeServer`, its workers scripted) on one end of a
socket pair, the pool's :class:`~envfleet.backends.nodes.link.NodeLink` on the other, as in
``test_node_server``."""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection

import numpy as np
import pytest
from gymnasium import spaces

from envfleet.backends.contract import raw_parts
from envfleet.backends.nodes.frames import Frames
from envfleet.buffers import Batch
from envfleet.errors import Phase
from envfleet.protocol import EnvFailure, Reply, Sample
from envfleet.rollout_loop import Sampled
from envfleet.rollouts import Out
from tests.test_node_server import (
    ACTIONS,
    ENVS,
    OBS,
    PER_WORKER,
    WORKERS,
    pair,
    sampled,
    setup,
)

__all__ = ["pair"]  # test_node_server's fixture (a socket pair), used here by name


LEAST = {"in place": 0, "observations in place": 4 * PER_WORKER * 3, "copied": 1 << 30}
"""raw_parts.LEAST_ROW: every field's step blocks read in place; only the observations' (12
bytes an env, the rest 8 or 1); none."""


@pytest.mark.parametrize("least", list(LEAST))
@pytest.mark.parametrize("case", ["whole", "policy failed", "cut short", "env failed"])
def test_a_nodes_rollout_parts_are_read_into_the_columns_the_pool_gave(
    pair: tuple[Connection, Connection], case: str, least: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part of a rollout travels as it came, its recorded arrays as raw bytes in a frame
    after the answer, read straight into the columns the pool gave for its command (views of
    the rollout's own arrays: nothing of the message to copy out) where a step's block is
    large; a small field, a part given none, or one that does not fit them (fewer steps), into
    arrays of its own, which the rollout copies in. Every value comes back as sent, in its
    dtype; infos, reset infos and final observations with the part."""
    monkeypatch.setattr(raw_parts, "LEAST_ROW", LEAST[least])
    server, workers, link = setup(pair)
    assert link.conn is not None
    frames = link.frames = Frames(link.conn.fileno())
    pool = Batch.local(OBS, ACTIONS, ENVS)
    ids = [tuple(range(w * PER_WORKER, (w + 1) * PER_WORKER)) for w in range(WORKERS)]
    commands = [Sample(i, 4, b"policy") for i in ids]
    int8 = spaces.Box(-128, 127, (), np.int8)
    layout = spaces.Dict({"a": spaces.Box(0, 1e3, (3,), np.float32), "b": spaces.Tuple([int8])})
    out = Out(layout, spaces.Discrete(9), 4, np.arange(ENVS, dtype=np.int64))
    given = {w: out.into(ids[w]) for w in range(WORKERS - 1)}  # none for the last worker
    for w, into in given.items():
        link.landing[commands[w]] = into
    assert server.handle(b"".join(link.round(range(WORKERS), list(commands), []) or []))
    parts = [sampled(i, 4) for i in ids]
    failures: tuple[EnvFailure, ...] = ()
    if case == "policy failed":
        parts[2].error = EnvFailure.capture(None, Phase.STEP, ValueError("policy"))
    elif case == "cut short":
        parts[1] = sampled(ids[1], 3)
    elif case == "env failed":
        failures = (EnvFailure.capture(5, Phase.STEP, ValueError("env 5")),)
    sent = [dataclasses.replace(part) for part in parts]  # the agent swaps its arrays out
    for w in range(WORKERS):
        reply = Reply(values={ids[w][0]: parts[w]}, failures=failures if w == 2 else ())
        workers.finish(w, reply=reply)
    server.collect()
    data = frames.read()
    assert len(data) < 4096  # the recorded arrays are not in it
    fields = [pool.observations, pool.rewards, pool.terminations, pool.truncations]
    got = link.take(data, fields, pool, OBS, np.zeros(ENVS, np.int64))
    assert not link.landing and not frames.ready()  # each given taken; the frame read whole
    for w, (_, answer) in enumerate(got):
        assert isinstance(answer, Reply) and answer.values is not None
        part, want = answer.values[ids[w][0]], sent[w]
        assert isinstance(part, Sampled) and (part.env_ids, part.steps) == (ids[w], want.steps)
        for name in ("actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(part, name), getattr(want, name), err_msg=name)
            assert getattr(part, name).dtype == getattr(want, name).dtype, name
        for nest in ("observations", "final_observations"):
            np.testing.assert_array_equal(getattr(part, nest)["a"], getattr(want, nest)["a"])
            np.testing.assert_array_equal(getattr(part, nest)["b"][0], getattr(want, nest)["b"][0])
        assert part.observations["b"][0].dtype == np.int8
        assert (part.infos, part.reset_infos) == (want.infos, want.reset_infos)
        assert (part.error is None) is (want.error is None)
        landed = w in given and want.steps == 4 and least != "copied"
        small = landed and least == "in place"  # the fields of 8 bytes or fewer an env
        assert np.shares_memory(part.observations["a"], out.observations["a"]) is landed
        assert np.shares_memory(part.observations["b"][0], out.observations["b"][0]) is small
        assert (part.rewards is given[w].rewards) is small if w in given else True
        if w in given and want.steps == 4:  # the rollout's columns: read in place or copied
            columns = list(ids[w])
            out.add(part, slice(columns[0], columns[-1] + 1), given[w])
            np.testing.assert_array_equal(out.observations["a"][:, columns], want.observations["a"])
            np.testing.assert_array_equal(
                out.observations["b"][0][:, columns], want.observations["b"][0]
            )
            for name in ("actions", "rewards", "terminations", "truncations"):
                np.testing.assert_array_equal(getattr(out, name)[:, columns], getattr(want, name))


def test_a_parts_frames_travel_compressed_a_block_per_step_into_the_columns() -> None:
    """With a codec (a node's ``compress=``), each observation array of frames goes as one
    compressed block per step, decompressed once read straight into the rollout's columns;
    the other fields go raw. Blocks that come to a pool that cannot decompress them: an error
    that says why, not values."""
    from envfleet.backends.nodes.compression import codec

    lz4 = codec("lz4")
    assert lz4 is not None
    ids, steps = (2, 3), 5
    frames = np.zeros((steps, 2, 6, 8), np.float32)
    frames[:, :, 1:3, 2:5] = np.random.default_rng(0).normal(size=(steps, 2, 2, 3))
    base = sampled(ids, steps)
    part = dataclasses.replace(base, observations={"a": frames, "b": base.observations["b"]})
    int8 = spaces.Box(-128, 127, (), np.int8)
    image = spaces.Box(-np.inf, np.inf, (6, 8), np.float32)
    layout = spaces.Dict({"a": image, "b": spaces.Tuple([int8])})
    out = Out(layout, spaces.Discrete(9), steps, np.arange(ENVS, dtype=np.int64))
    reply = Reply(values={2: dataclasses.replace(part)})
    sent = raw_parts.strip([reply], lz4)
    assert sent is not None
    (stripped,) = raw_parts.stripped(reply)
    raw_a, raw_b = stripped.observations["a"], stripped.observations["b"][0]
    assert len(raw_a.packed) == steps and raw_b.packed == ()  # frames only
    data = b"".join(bytes(view) for view in sent)
    assert len(data) < frames.nbytes / 2
    with pytest.raises(ValueError, match="compressed to a pool without compress="):
        raw_parts.destinations(dataclasses.replace(stripped), out.into(ids))
    unpacks: list[raw_parts.Unpack] = []
    into = out.into(ids)
    buffers = raw_parts.destinations(stripped, into, unpacks=unpacks)
    at = 0
    for buffer in buffers:  # as Frames.read_into fills them: in order
        buffer[:] = np.frombuffer(data, np.uint8, buffer.size, at)
        at += buffer.size
    assert at == len(data)
    with pytest.raises(ValueError, match="compressed to a pool without compress="):
        raw_parts.unpack(unpacks, None)
    raw_parts.unpack(unpacks, lz4)
    assert np.shares_memory(stripped.observations["a"], out.observations["a"])  # in place
    np.testing.assert_array_equal(stripped.observations["a"], frames)
    np.testing.assert_array_equal(stripped.observations["b"][0], part.observations["b"][0])
    np.testing.assert_array_equal(stripped.rewards, part.rewards)
