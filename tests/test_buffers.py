"""The batch arrays on their own: allocation, row writers and readers, put/take, per space.

Array spaces (Box, Discrete, MultiDiscrete, MultiBinary and Dict/Tuple nests of them) live in
numpy arrays, local or shared, laid out as Gymnasium's ``batch_space`` would batch them; every
other space takes the pickled path (a list of objects). The oracle is Gymnasium's own batching.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array
from hypothesis import given, settings
from hypothesis import strategies as st

from envfleet.buffers import (
    Batch,
    ObjectRows,
    SharedBatch,
    allocate_local,
    is_array_space,
    put,
    take,
)
from envfleet.row_access import make_reader, make_writer

N = 5

ARRAY_SPACES: dict[str, spaces.Space[Any]] = {
    "box-float32": spaces.Box(-1.0, 1.0, shape=(3, 2), dtype=np.float32),
    "box-uint8-image": spaces.Box(0, 255, shape=(4, 4, 3), dtype=np.uint8),
    "box-float64-scalar": spaces.Box(-5.0, 5.0, shape=(), dtype=np.float64),
    "box-int16": spaces.Box(-3, 3, shape=(2,), dtype=np.int16),
    "discrete": spaces.Discrete(7, start=-2),
    "multidiscrete": spaces.MultiDiscrete([3, 5, 2]),
    "multidiscrete-2d": spaces.MultiDiscrete(np.array([[2, 3], [4, 5]]), dtype=np.int32),
    "multibinary": spaces.MultiBinary(4),
    "dict": spaces.Dict({"a": spaces.Discrete(3), "b": spaces.Box(0, 1, (2,), np.float32)}),
    "tuple": spaces.Tuple((spaces.MultiBinary(2), spaces.Discrete(4))),
    "nested": spaces.Dict(
        {
            "pos": spaces.Box(-1, 1, (2,), np.float32),
            "pair": spaces.Tuple(
                (spaces.Discrete(5), spaces.Dict({"g": spaces.MultiDiscrete([3])}))
            ),
        }
    ),
}

PICKLED_SPACES: dict[str, spaces.Space[Any]] = {
    "text": spaces.Text(8),
    "sequence": spaces.Sequence(spaces.Discrete(4)),
    "graph": spaces.Graph(node_space=spaces.Box(0, 1, (2,)), edge_space=spaces.Discrete(3)),
    "oneof": spaces.OneOf((spaces.Discrete(2), spaces.Box(0, 1, (2,)))),
    "dict-with-text": spaces.Dict({"a": spaces.Discrete(2), "t": spaces.Text(4)}),
}


def _assert_same(ours: Any, theirs: Any) -> None:
    """Equal nested batches, dtypes and shapes included."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs)
        for key in theirs:
            _assert_same(ours[key], theirs[key])
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _assert_same(a, b)
    else:
        assert isinstance(ours, np.ndarray)
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        np.testing.assert_array_equal(ours, theirs)


def _sample_batch(space: spaces.Space[Any], n: int, seed: int) -> Any:
    batched = batch_space(space, n)
    batched.seed(seed)
    return batched.sample()


def _shared(space: spaces.Space[Any], n: int) -> Any:
    """The observation arrays of a shared batch for ``space`` (viewed in this process)."""
    handles = SharedBatch.allocate(space, spaces.Discrete(2), n, multiprocessing.get_context())
    return handles.views().observations


@pytest.mark.parametrize("memory", ["local", "shared"])
@pytest.mark.parametrize("name", list(ARRAY_SPACES))
def test_array_spaces_round_trip_with_gymnasium_layout(name: str, memory: str) -> None:
    space = ARRAY_SPACES[name]
    assert is_array_space(space)
    batch = allocate_local(space, N) if memory == "local" else _shared(space, N)
    _assert_same(batch, create_empty_array(space, N, fn=np.zeros))  # layout and dtypes, zeroed
    values = _sample_batch(space, N, seed=1)
    put(space, batch, None, values)
    _assert_same(take(space, batch, None), values)
    ids = np.array([3, 0])
    rows = _sample_batch(space, 2, seed=2)
    put(space, batch, ids, rows)
    _assert_same(take(space, batch, ids), rows)
    untouched = np.array([1, 2, 4])
    _assert_same(take(space, batch, untouched), take(space, values, untouched))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(ARRAY_SPACES))
def test_row_writer_and_reader_give_back_one_env_value(name: str) -> None:
    space = ARRAY_SPACES[name]
    batch = allocate_local(space, N)
    write, read = make_writer(space, batch), make_reader(space, batch)
    space.seed(4)
    samples = [space.sample() for _ in range(N)]
    for i in (4, 0, 2, 1, 3):
        write(i, samples[i])
    for i, sample in enumerate(samples):
        back = read(i)
        assert space.contains(np.asarray(back) if isinstance(space, spaces.Box) else back)
        _assert_same(
            concatenate(space, [back], create_empty_array(space, 1, fn=np.zeros)),
            concatenate(space, [sample], create_empty_array(space, 1, fn=np.zeros)),
        )
    _assert_same(
        take(space, batch, None),
        concatenate(space, samples, create_empty_array(space, N, fn=np.zeros)),
    )


def test_discrete_rows_read_as_numpy_ints() -> None:
    """As ``SyncVectorEnv`` hands a Discrete env its action from a numpy batch: ``np.int64``."""
    space = spaces.Discrete(4)
    batch = allocate_local(space, 2)
    make_writer(space, batch)(1, np.int64(3))
    value = make_reader(space, batch)(1)
    assert type(value) is np.int64 and value == 3


@pytest.mark.parametrize("name", list(PICKLED_SPACES))
def test_other_spaces_take_the_pickled_path(name: str) -> None:
    space = PICKLED_SPACES[name]
    assert not is_array_space(space)
    batch = allocate_local(space, N)
    assert isinstance(batch, ObjectRows) and list(batch) == [None] * N
    shared = SharedBatch.allocate(space, space, N, multiprocessing.get_context())
    assert shared.observations is None and shared.actions is None
    views = shared.views()
    assert isinstance(views.observations, ObjectRows) and isinstance(views.actions, ObjectRows)
    write, read = make_writer(space, batch), make_reader(space, batch)
    space.seed(5)
    samples = [space.sample() for _ in range(N)]
    for i, sample in enumerate(samples):
        write(i, sample)
    assert all(read(i) is samples[i] for i in range(N))
    expected = concatenate(space, samples, create_empty_array(space, N, fn=np.zeros))
    ours = take(space, batch, None)
    assert type(ours) is type(expected)
    assert repr(take(space, batch, np.array([2, 0]))) == repr(
        concatenate(space, [samples[2], samples[0]], create_empty_array(space, 2, fn=np.zeros))
    )


def test_local_batch_fields_have_the_pool_dtypes() -> None:
    batch = Batch.local(ARRAY_SPACES["nested"], ARRAY_SPACES["multidiscrete"], N)
    assert batch.rewards.dtype == np.float64 and batch.rewards.shape == (N,)
    assert batch.terminations.dtype == np.bool_ and batch.truncations.dtype == np.bool_
    assert batch.actions.shape == (N, 3) and batch.actions.dtype == np.int64
    views = SharedBatch.allocate(
        ARRAY_SPACES["nested"], ARRAY_SPACES["multidiscrete"], N, multiprocessing.get_context()
    ).views()
    for field in ("rewards", "terminations", "truncations", "actions"):
        ours, theirs = getattr(views, field), getattr(batch, field)
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)


DTYPES = st.sampled_from([np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8])
SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


@settings(max_examples=25, deadline=None)
@given(dtype=DTYPES, shape=SHAPES, n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_any_box_round_trips_in_shared_memory(
    dtype: type[np.generic], shape: tuple[int, ...], n: int, seed: int
) -> None:
    low, high = (-10, 10) if np.issubdtype(dtype, np.signedinteger) else (0, 10)
    space = spaces.Box(low, high, shape=shape, dtype=dtype)
    batch = _shared(space, n)
    values = _sample_batch(space, n, seed)
    put(space, batch, None, values)
    out = take(space, batch, None)
    _assert_same(out, values)
    write, read = make_writer(space, batch), make_reader(space, batch)
    write(n - 1, values[0])
    np.testing.assert_array_equal(read(n - 1), values[0])
