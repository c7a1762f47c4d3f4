"""Infos as columns: what a worker process sends when every env's info is plain scalars, and the
pool's table of them (:class:`~envfleet.infos.InfoTable`).

The oracle is Gymnasium's ``_add_info`` (``tests.test_infos.gymnasium_infos``) for the table on
its own, and ``SyncVectorEnv`` for process pools whose envs' infos change keys, types and shapes
from step to step, in every autoreset mode.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

import envfleet
from envfleet.backends.contract import framing
from envfleet.errors import Phase
from envfleet.info_columns import column_dicts, info_columns, layout_of
from envfleet.infos import InfoTable, merge_infos
from envfleet.protocol import EnvFailure, Reply
from tests.test_equivalence import MODES, NUM_ENVS, Case, Record, assert_same_run, drive
from tests.test_infos import assert_same, gymnasium_infos


def test_plain_scalar_infos_travel_as_columns_and_come_back_as_sent() -> None:
    infos = {
        4: {"lives": 3, "frame": np.int32(7), "p": 0.5, "ok": True},
        6: {"lives": 2, "frame": np.int32(9), "p": -1.0, "ok": False},
    }
    columns = info_columns(infos)
    assert columns is not None and columns[0] == (4, 6)
    assert layout_of(columns[1]) == (("lives", "frame", "p", "ok"), (int, np.int32, float, bool))
    back = column_dicts(columns)
    assert back == infos
    for i, info in infos.items():  # the very types: a Python bool stays a bool, not np.bool_
        assert [type(v) for v in back[i].values()] == [type(v) for v in info.values()]


@pytest.mark.parametrize(
    "infos",
    [
        {0: {"a": 1}, 1: {"a": 1.0}},  # one key, two types
        {0: {"a": 1, "b": 2}, 1: {"b": 2, "a": 1}},  # another order
        {0: {"a": 1}, 1: {"a": 1, "b": 2}},  # another key
        {0: {"a": np.zeros(2)}},  # not a scalar
        {0: {"a": np.bool_(True)}},  # not an np.number: an object array in Gymnasium
        {0: {"final_obs": 1}},  # an object array in Gymnasium, whatever its value
        {0: {"a": "text"}},
        {0: {"a": {"b": 1}}},
        {0: {"a": 2**70}},  # past int64: Gymnasium's merge raises OverflowError
        {0: {"a": np.timedelta64(5, "s")}},  # its unit is not in its type
        {0: {}, 1: {}},
    ],
)
def test_other_infos_travel_as_dicts(infos: dict[int, dict[str, Any]]) -> None:
    assert info_columns(infos) is None
    encoded = framing.encode_reply(Reply(env_ids=tuple(infos), infos=infos))
    assert encoded[0] == framing.FRAME


def test_a_columns_reply_reads_as_plain_with_its_infos_in_the_table() -> None:
    infos = {0: {"lives": 3, "frame": 10}, 1: {"lives": 3, "frame": 11}}
    encoded = framing.encode_reply(Reply(env_ids=(0, 1, 2), infos=infos))
    assert encoded[0] == framing.COLUMNS
    table = InfoTable(3)
    out: list[Reply | None] = []
    framing.FrameReader(table.put).feed(encoded + encoded[:5], out)  # and the start of the next
    assert out == [None] and table.pending
    got = table.take(np.arange(3), None, 3, None)
    assert_same(got, gymnasium_infos([infos[0], infos[1], None]))
    assert not table.pending
    # With no table (a node agent's transport, which forwards replies): the reply, as sent.
    out = []
    framing.FrameReader().feed(encoded, out)
    assert isinstance(out[0], Reply) and out[0].env_ids == (0, 1, 2) and out[0].infos == infos
    # An env id that does not fit the columns frame's 4 bytes: the reply goes pickled.
    far = {2**40: infos[0]}
    encoded = framing.encode_reply(Reply(env_ids=(2**40,), infos=far))
    assert encoded[0] == framing.FRAME
    out = []
    framing.FrameReader(InfoTable(3).put).feed(encoded, out)
    assert isinstance(out[0], Reply) and out[0].infos == far
    # Failures, restarts or values alongside: the whole reply as a frame.
    failure = EnvFailure.capture(1, Phase.STEP, ValueError("x"))
    encoded = framing.encode_reply(Reply(env_ids=(0, 1), infos=infos, failures=(failure,)))
    assert encoded[0] == framing.FRAME


def test_columns_replies_are_read_without_unpickling_and_in_any_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A columns reply is read with no pickle (the hot path of Atari and MuJoCo), whole or
    arriving in pieces, and whether its infos name all the reply's envs or some."""
    whole = {0: {"lives": 3, "frame": 10}, 1: {"lives": 2, "frame": 11}}
    some = {5: {"lives": 1, "frame": 12}}
    replies = [Reply(env_ids=(0, 1), infos=whole), Reply(env_ids=(4, 5, 6), infos=some)]
    encoded = [framing.encode_reply(reply) for reply in replies]
    assert [data[0] for data in encoded] == [framing.COLUMNS] * 2

    def no_pickle(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a columns reply was unpickled")

    columns = info_columns(whole)
    assert columns is not None
    layout_of(columns[1])  # a layout is unpickled once, the first time it comes

    monkeypatch.setattr(framing.pickle, "loads", no_pickle)
    for pieces in (encoded, [bytes([byte]) for data in encoded for byte in data]):
        out: list[Reply | None] = []
        reader = framing.FrameReader()  # no table: the replies come back as sent
        for data in pieces:
            reader.feed(data, out)
        assert [(r.env_ids, r.infos) for r in out] == [(r.env_ids, r.infos) for r in replies]  # type: ignore[union-attr]
        table = InfoTable(7)
        out = []
        reader = framing.FrameReader(table.put)
        for data in pieces:
            reader.feed(data, out)
        assert out == [None, None] and not reader.partial
        got = table.take(np.arange(7), None, 7, None, whole=True)
        assert_same(got, gymnasium_infos([whole[0], whole[1], None, None, None, some[5], None]))


def test_a_reader_takes_each_columns_reply_for_what_it_says() -> None:
    """Replies of one worker, one after another, each read whole: the same envs and layout with
    new values, other envs, another layout of the same size, other reply env ids: each comes
    back as sent (a reader that knows the last reply's envs and layout reads only the new
    records when nothing else changed)."""
    sent = [
        Reply(env_ids=(0, 1), infos={0: {"a": 1, "b": 2}, 1: {"a": 3, "b": 4}}),
        Reply(env_ids=(0, 1), infos={0: {"a": 5, "b": 6}, 1: {"a": 7, "b": 8}}),
        Reply(env_ids=(2, 3), infos={2: {"a": 5, "b": 6}, 3: {"a": 7, "b": 8}}),
        Reply(env_ids=(2, 3), infos={2: {"c": 5, "d": 6}, 3: {"c": 7, "d": 8}}),
        Reply(env_ids=(2, 3), infos={2: {"c": 5.0, "d": 6}, 3: {"c": 7.0, "d": 8}}),
        Reply(env_ids=(2, 4), infos={2: {"c": 5.0, "d": 6}, 4: {"c": 7.0, "d": 8}}),
        Reply(env_ids=(1, 2, 4), infos={2: {"c": 5.0, "d": 6}, 4: {"c": 7.0, "d": 8}}),
        Reply(env_ids=(2, 4), infos={2: {"c": 1.0, "d": 2}, 4: {"c": 3.0, "d": 4}}),
    ]
    reader = framing.FrameReader()
    for reply in sent:
        out: list[Reply | None] = []
        reader.feed(framing.encode_reply(reply), out)
        assert len(out) == 1 and isinstance(out[0], Reply)
        assert (out[0].env_ids, out[0].infos) == (reply.env_ids, reply.infos)
        for i, info in reply.infos.items():  # type: ignore[union-attr]
            assert [type(v) for v in out[0].infos[i].values()] == [type(v) for v in info.values()]  # type: ignore[index]


_SIGNALING_NAN32 = np.frombuffer(b"\x01\x00\x80\x7f", dtype=np.float32)[0]
"""A float32 NaN whose bits a trip through a Python float would change."""


@pytest.mark.parametrize(
    "value",
    [
        _SIGNALING_NAN32,
        2**63 - 1,
        -(2**63),
        np.uint64(2**64 - 1),
        np.int8(-128),
        np.uint16(65535),
        np.int32(-7),
        np.longlong(-(2**62)),
        np.ulonglong(2**63),
        float("nan"),
        -0.0,
        1e308,
        np.float64(-1.5e-300),
        np.float32(1 / 3),
        np.float16(0.1),
        True,
    ],
)
def test_every_plain_scalar_type_comes_back_bit_for_bit(value: Any) -> None:
    infos = {0: {"v": value, "n": 1}, 1: {"v": value, "n": 2}}
    columns = info_columns(infos)
    assert columns is not None
    back = column_dicts(columns)
    for i in infos:
        assert type(back[i]["v"]) is type(value)
        assert np.array(back[i]["v"]).tobytes() == np.array(value).tobytes()
    table = InfoTable(2)
    table.put(columns)
    assert_same(
        table.take(np.arange(2), None, 2, None, whole=True), gymnasium_infos([infos[0], infos[1]])
    )


def test_each_array_handed_out_is_the_callers_own() -> None:
    """Every column and mask of a batch is an array of its own: the next batch leaves it as it
    was, and writing one changes no other."""
    table = InfoTable(4)

    def step(frame: int) -> list[dict[str, Any]]:
        infos = [{"lives": 3, "frame": frame + i, "p": 0.5} for i in range(4)]
        for ids in ((0, 1), (2, 3)):
            columns = info_columns({i: infos[i] for i in ids})
            assert columns is not None
            table.put(columns)
        return infos

    first = step(0)
    got = table.take(np.arange(4), None, 4, None, whole=True)
    second = step(100)
    assert_same(got, gymnasium_infos(first))
    assert_same(table.take(np.arange(4), None, 4, None, whole=True), gymnasium_infos(second))
    for key in ("lives", "frame", "p"):
        assert got[key].flags.c_contiguous and got[key].flags.writeable
    got["_lives"][0] = False
    got["frame"][1] = -1
    assert got["_frame"].all() and got["_p"].all() and got["lives"][1] == 3
    third = step(200)
    got = table.take(np.array([2, 3]), None, 2, None)  # some envs: the same
    step(300)
    assert_same(got, gymnasium_infos(third[2:]))


SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "i": st.integers(-5, 5),
    "f": st.floats(-1, 1, allow_nan=False),
    "b": st.booleans(),
    "n32": st.floats(-1, 1, allow_nan=False, width=32).map(np.float32),
    "u8": st.integers(0, 255).map(np.uint8),
}
OTHERS: dict[str, st.SearchStrategy[Any]] = {
    "arr": st.lists(st.integers(0, 9), min_size=2, max_size=2).map(np.array),
    "s": st.text(max_size=2),
    "i": st.floats(-1, 1, allow_nan=False),  # a float where the others have an int
}
LAYOUTS = st.lists(st.sampled_from(sorted(SCALARS)), min_size=1, max_size=4, unique=True)


@st.composite
def step_infos(draw: st.DrawFn, num_envs: int) -> list[dict[str, Any] | None]:
    """One step's infos: mostly one layout of scalars for every env; now and then an env with
    none, another layout, or values that are not plain scalars."""
    keys = draw(LAYOUTS)
    infos: list[dict[str, Any] | None] = []
    for _ in range(num_envs):
        kind = draw(st.sampled_from(["same"] * 6 + ["none", "other", "odd"]))
        if kind == "none":
            infos.append(draw(st.sampled_from([None, {}])))
            continue
        env_keys = draw(LAYOUTS) if kind == "other" else keys
        info = {k: draw(SCALARS[k]) for k in env_keys}
        if kind == "odd":
            key = draw(st.sampled_from(sorted(OTHERS)))
            info[key] = draw(OTHERS[key])
        infos.append(info)
    return infos


def deliver(
    table: InfoTable, dicts: dict[int, dict[str, Any]], infos: list[dict[str, Any] | None]
) -> list[tuple[int, ...]]:
    """Send ``infos`` as two workers' replies (envs ``0..k-1`` and ``k..``) would: columns into
    ``table``, the rest into ``dicts`` (the ledger's); returns the workers' env ids."""
    half = len(infos) // 2
    workers = [tuple(range(half)), tuple(range(half, len(infos)))]
    for ids in workers:
        sent = {i: info for i in ids if (info := infos[i])}
        if not sent:
            continue
        columns = info_columns(sent)
        if columns is None:
            dicts.update(sent)
        else:
            assert column_dicts(columns) == sent
            table.put(columns)
    return workers


def take(
    table: InfoTable, dicts: dict[int, dict[str, Any]], env_ids: list[int], size: int
) -> dict[str, Any]:
    """What the pool returns for ``env_ids`` handed out in that order (the ledger's dicts too)."""
    pairs = [(dicts.pop(i, None), p) for p, i in enumerate(env_ids)]
    if table.pending:
        whole = env_ids == list(range(len(table._has)))  # every env of the pool, in order
        return table.take(np.array(env_ids), None, size, pairs if dicts or pairs else None, whole)
    return merge_infos(pairs, size)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), num_envs=st.integers(1, 6), steps=st.integers(1, 4))
def test_the_table_gives_what_gymnasium_gives_in_any_order(
    data: st.DataObject, num_envs: int, steps: int
) -> None:
    """Several steps of one pool: each hands out every env, in one batch in order (sync) or in
    batches of any envs in any order (async), while layouts change between steps."""
    table, dicts = InfoTable(num_envs), {}  # type: ignore[var-annotated]
    for _ in range(steps):
        infos = data.draw(step_infos(num_envs))
        deliver(table, dicts, infos)
        order = data.draw(st.permutations(range(num_envs)))
        if data.draw(st.booleans()):
            order = list(range(num_envs))
        cut = data.draw(st.integers(1, num_envs))
        for batch in (order[:cut], order[cut:]):
            if batch:
                theirs = gymnasium_infos([infos[i] for i in batch])
                assert_same(take(table, dicts, batch, len(batch)), theirs)
        assert not dicts


def test_records_of_an_earlier_layout_are_handed_out_as_they_were_sent() -> None:
    """Envs 0-1 wait with one layout while envs 2-3 bring another (async): each batch still
    gets exactly its envs' infos."""
    table = InfoTable(4)
    first = {0: {"a": 1, "b": 0.5}, 1: {"a": 2, "b": 1.5}}
    second = {2: {"b": np.float32(1), "c": True}, 3: {"b": np.float32(2), "c": False}}
    for infos in (first, second):
        columns = info_columns(infos)
        assert columns is not None
        table.put(columns)
    assert_same(table.take(np.array([3, 0]), None, 2, None), gymnasium_infos([second[3], first[0]]))
    assert_same(table.take(np.array([1, 2]), None, 2, None), gymnasium_infos([first[1], second[2]]))
    assert not table.pending
    # The next step's records of env 0 replace nothing stale: only they come back.
    columns = info_columns({0: {"a": 5, "b": 2.5}})
    assert columns is not None
    table.put(columns)
    assert_same(
        table.take(np.arange(4), None, 4, None, whole=True),
        gymnasium_infos([{"a": 5, "b": 2.5}, None, None, None]),
    )


def test_reset_infos_land_at_their_envs_positions() -> None:
    table = InfoTable(4)
    infos = {1: {"lives": 3}, 3: {"lives": 2}}
    columns = info_columns(infos)
    assert columns is not None
    table.put(columns)
    got = table.take(np.array([1, 3]), np.array([1, 3]), 4, None)
    assert_same(got, gymnasium_infos([None, infos[1], None, infos[3]]))


class InfoShiftEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Infos that change from step to step: plain scalars most steps (the columns), with now
    and then a new key, another key order, an array, an np.bool_, a float where an int was, a
    type that depends on the env's own random stream, or no info at all."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, shape=(3,), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)
        self._t = 0
        self._calls = 0  # the schedule of keys: every env the same, whatever its episodes

    def _info(self) -> dict[str, Any]:
        t, rng = self._calls, self.np_random
        self._calls += 1
        info: dict[str, Any] = {"lives": 3 - self._t % 3, "frame": 4 * self._t}
        if t % 7 == 3:
            info["bonus"] = 0.25 * t
        if t % 11 == 5:
            info = dict(reversed(info.items()))
        if t % 13 == 8:
            info["vec"] = np.arange(2) + t
        if t % 17 == 9:
            info["flag"] = np.bool_(t % 2)
        if t % 5 == 2:
            info["x"] = np.float32(t) if rng.random() < 0.5 else float(t)
        if t % 9 == 4:
            info["lives"] = float(t)
        if t % 6 == 1 and rng.random() < 0.3:
            info = {}
        return info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = int(self.np_random.integers(4))
        return self.np_random.integers(256, size=3, dtype=np.uint8), self._info()

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        terminated = self.np_random.random() < 0.08
        return (
            np.full(3, self._t % 256, dtype=np.uint8),
            float(action),
            terminated,
            False,
            self._info(),
        )


INFO_SHIFT = Case(InfoShiftEnv, steps=60, min_episodes=10)


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_process_pools_give_sync_vector_envs_infos_as_they_shift(mode: AutoresetMode) -> None:
    reference = SyncVectorEnv([InfoShiftEnv] * NUM_ENVS, autoreset_mode=mode)
    try:
        expected: list[Record] = list(drive(reference, INFO_SHIFT, mode))
    finally:
        reference.close()
    pool = envfleet.make(
        InfoShiftEnv, NUM_ENVS, backend="process", num_workers=2, autoreset_mode=mode
    )
    try:
        assert_same_run(expected, pool, INFO_SHIFT, mode, f"process/2 {mode.name}")
    finally:
        pool.close()


def test_async_batches_of_any_envs_get_each_envs_own_infos() -> None:
    """Async ``recv`` hands out whichever envs are ready: each batch's infos are those of its
    envs, in its order, as ``_add_info`` merges them (each env stepped on its own as the
    oracle, NEXT_STEP autoreset by hand)."""
    assert_async_infos(backend="process", num_workers=2)


def assert_async_infos(**layout: Any) -> None:
    """:func:`test_async_batches_of_any_envs_get_each_envs_own_infos` on a pool of ``layout``
    (``envfleet.make``'s keyword arguments)."""
    num_envs, seed = 7, 11
    alone = [InfoShiftEnv() for _ in range(num_envs)]
    ended = [False] * num_envs

    def expected_info(i: int) -> dict[str, Any]:
        if ended[i]:
            ended[i] = False
            return alone[i].reset()[1]
        _, _, terminated, truncated, info = alone[i].step(np.int64(0))
        ended[i] = terminated or truncated
        return info

    pool = envfleet.make(InfoShiftEnv, num_envs, batch_size=3, **layout)
    try:
        pool.async_reset(seed=seed)
        pending = {i: env.reset(seed=seed + i)[1] for i, env in enumerate(alone)}
        for _ in range(40):
            *_, infos = pool.recv()
            env_ids = infos.pop("env_id")
            assert_same(infos, gymnasium_infos([pending.pop(int(i)) for i in env_ids]))
            pool.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
            for i in env_ids.tolist():
                pending[i] = expected_info(i)
    finally:
        pool.close()
