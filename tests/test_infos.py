"""merge_infos on its own: the batch of infos Gymnasium's ``VectorEnv._add_info`` would build.

The oracle is Gymnasium's own ``_add_info``, applied env by env in batch order; ``merge_infos``
takes ``(info, position)`` pairs in any order (async batches hold whichever envs were ready).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import VectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

from envfleet.infos import merge_infos


def gymnasium_infos(infos: list[dict[str, Any] | None]) -> dict[str, Any]:
    """What Gymnasium's vector envs return for these per-env infos (env ``i`` at row ``i``)."""
    vector = SimpleNamespace(num_envs=len(infos))
    vector._add_info = lambda *args: VectorEnv._add_info(vector, *args)  # type: ignore[arg-type]
    merged: dict[str, Any] = {}
    for i, info in enumerate(infos):
        if info:
            merged = VectorEnv._add_info(vector, merged, info, i)  # type: ignore[arg-type]
    return merged


def assert_same(ours: Any, theirs: Any, where: str = "infos") -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert sorted(ours) == sorted(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), where
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        if theirs.dtype == object:
            for a, b in zip(ours, theirs, strict=True):
                assert_same(a, b, where)
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=where)
    else:
        assert type(ours) is type(theirs) and ours == theirs, where


def merged(infos: list[dict[str, Any] | None], order: list[int]) -> dict[str, Any]:
    return merge_infos([(infos[i], i) for i in order], len(infos))


def test_empty_and_missing_infos() -> None:
    assert merged([None, {}, None], [0, 1, 2]) == {}
    assert_same(merged([None, {"a": 1}, {}], [2, 0, 1]), gymnasium_infos([None, {"a": 1}, {}]))


def test_uniform_scalar_infos_take_the_fast_path_with_the_same_result() -> None:
    infos: list[dict[str, Any] | None] = [
        {"lives": 3, "frame": np.int64(10 + i), "p": 0.5 * i, "ok": bool(i % 2)} for i in range(5)
    ]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        assert_same(merged(infos, order), gymnasium_infos(infos))
    # The same keys in another order, their types swapped along: as Gymnasium merges them.
    swapped: list[dict[str, Any] | None] = [{"a": 1, "b": 2.5}, {"b": 3, "a": 4.5}]
    assert_same(merged(swapped, [0, 1]), gymnasium_infos(swapped))


def test_final_obs_nested_dicts_arrays_and_objects() -> None:
    infos: list[dict[str, Any] | None] = [
        {"final_obs": np.arange(3), "final_info": {"t": 3, "x": np.ones(2)}, "name": "a"},
        None,
        {"episode": {"r": 1.5, "l": 7}, "name": "c", "t": np.float32(2.5)},
        {"final_obs": {"pos": np.zeros(2)}, "final_info": {}, "t": np.float32(1.0)},
    ]
    assert_same(merged(infos, [3, 1, 0, 2]), gymnasium_infos(infos))


def test_a_partial_batch_fills_only_its_rows() -> None:
    infos = [{"a": 1.0}, {"a": 2.0}, {"a": 3.0}]
    out = merge_infos([(infos[2], 2), (infos[0], 0)], 3)
    assert out["a"].tolist() == [1.0, 0.0, 3.0]
    assert out["_a"].tolist() == [True, False, True]


# A key's type is fixed per key (as an env's infos are), so every arrival order must agree.
KEY_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "i": st.integers(-5, 5),
    "f": st.floats(-1, 1, allow_nan=False),
    "b": st.booleans(),
    "n32": st.floats(-1, 1, allow_nan=False, width=32).map(np.float32),
    "arr": st.lists(st.integers(0, 9), min_size=2, max_size=2).map(np.array),
    "s": st.text(max_size=3),
    "final_obs": st.integers(0, 3).map(np.arange),
    "sub": st.fixed_dictionaries({"x": st.integers(0, 3)}, optional={"y": st.booleans()}),
}
INFO = st.one_of(
    st.none(),
    st.dictionaries(st.sampled_from(sorted(KEY_VALUES)), st.just(None), max_size=5).flatmap(
        lambda keys: st.fixed_dictionaries({k: KEY_VALUES[k] for k in keys})
    ),
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), infos=st.lists(INFO, min_size=1, max_size=6))
def test_matches_gymnasium_in_any_arrival_order(
    data: st.DataObject, infos: list[dict[str, Any] | None]
) -> None:
    order = data.draw(st.permutations(range(len(infos))))
    assert_same(merged(infos, order), gymnasium_infos(infos))


@settings(max_examples=30, deadline=None)
@given(
    infos=st.lists(
        st.fixed_dictionaries({"v": st.one_of(st.integers(-(2**62), 2**62), st.floats())})
    )
)
def test_mixed_types_in_batch_order_match_gymnasium(infos: list[dict[str, Any] | None]) -> None:
    """An int key that later gets a float is cast as Gymnasium casts it, or fails as it fails."""
    if not infos:
        return
    try:
        theirs = gymnasium_infos(infos)
    except (OverflowError, ValueError) as exc:  # a float too large for the int array
        with pytest.raises(type(exc)):
            merged(infos, list(range(len(infos))))
        return
    assert_same(merged(infos, list(range(len(infos)))), theirs)
