"""One env's row of a batch, written and read: the functions resolved once per space and
called per env per step (:func:`make_writer`, :func:`make_reader`, one registered per Gymnasium
space with ``singledispatch``).

A writer refuses what Gymnasium's vector envs refuse, in the env's own failure path: an
observation of another shape (numpy would broadcast it) or of a dtype that does not cast by
numpy's ``same_kind`` rule (:func:`~envfleet.buffers.fits_dtype`). A reader gives a copy of an
array row, never a view: an env that keeps its action must not see the next one written over it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import create_empty_array

from envfleet.buffers import ObjectRows, fits_dtype, is_array_space

__all__ = ["Reader", "Writer", "cast_refused", "make_reader", "make_writer"]

Writer = Callable[[int, Any], None]
Reader = Callable[[int], Any]


@singledispatch
def make_writer(space: spaces.Space[Any], batch: Any) -> Writer:
    """Return ``write(i, value)`` that stores one env's value in row ``i`` of ``batch``."""
    if isinstance(batch, ObjectRows):
        return batch.__setitem__
    raise TypeError(f"no row writer for space {space}")


@make_writer.register(spaces.Box)
@make_writer.register(spaces.Discrete)
@make_writer.register(spaces.MultiDiscrete)
@make_writer.register(spaces.MultiBinary)
def _write_array(space: spaces.Space[Any], batch: Any) -> Writer:
    if isinstance(batch, ObjectRows):
        return batch.__setitem__
    shape = batch.shape[1:]
    dtype = batch.dtype

    def write(i: int, value: Any) -> None:
        # An observation of another shape would be broadcast (a (1,) into every slot of a (4,)
        # row) or fail with no env named; one of another dtype would be cast whatever it holds
        # (300.7 or nan into uint8): refuse both, in the env's own failure path.
        if getattr(value, "shape", None) != shape and not (
            not shape and isinstance(value, int | float)  # a plain scalar for a scalar space
        ):
            value = _fitting(space, value, shape, dtype)
        elif getattr(value, "dtype", None) is not dtype and not fits_dtype(value, dtype):
            raise cast_refused(space, value, dtype)
        batch[i] = value

    return write


def _fitting(
    space: spaces.Space[Any], value: Any, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> Any:
    """``value`` as an array of ``shape``, or ``ValueError`` saying why it does not fit
    (``TypeError`` when only its dtype does not, see :func:`fits_dtype`)."""
    array = np.asarray(value)
    if array.shape != shape:
        what = "None" if value is None else f"shape {array.shape}, dtype {array.dtype}"
        raise ValueError(
            f"the env returned an observation ({what}) that does not fit its observation space "
            f"{space} (shape {shape})"
        )
    if not fits_dtype(array, dtype):
        raise cast_refused(space, array, dtype)
    return array


def cast_refused(space: spaces.Space[Any], value: Any, dtype: np.dtype[Any]) -> TypeError:
    """The ``TypeError`` for an observation whose dtype does not fit (:func:`fits_dtype`)."""
    source = getattr(value, "dtype", None)
    if not isinstance(source, np.dtype):
        source = np.asarray(value).dtype
    return TypeError(
        f"the env returned an observation of dtype {source} that does not fit its observation "
        f"space {space} (dtype {dtype}) without an unsafe cast: cannot cast {source} to "
        f"{dtype} according to the rule 'same_kind' (Gymnasium's vector envs raise TypeError "
        "here too)"
    )


def _stored_whole(space: spaces.Dict | spaces.Tuple[Any], batch: ObjectRows) -> Writer:
    """A writer for a Dict or Tuple whose values are stored whole (a part of it has no array
    layout: Text, Graph, ...): its array parts are checked first as Gymnasium's
    ``concatenate`` will write them (shape, dtype), by writing them into a scratch row."""
    check = make_writer(space, _scratch(space))

    def write(i: int, value: Any) -> None:
        check(0, value)
        batch[i] = value

    return write


def _scratch(space: spaces.Space[Any]) -> Any:
    """One row of ``space``, nested like it: arrays where the space has a layout."""
    if isinstance(space, spaces.Dict):
        return {key: _scratch(sub) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_scratch(sub) for sub in space.spaces)
    if is_array_space(space):
        return create_empty_array(space, 1, fn=np.zeros)
    return ObjectRows([None])


@make_writer.register(spaces.Dict)
def _write_dict(space: spaces.Dict, batch: Any) -> Writer:
    if isinstance(batch, ObjectRows):
        return _stored_whole(space, batch)
    writers = [(key, make_writer(sub, batch[key])) for key, sub in space.spaces.items()]

    def write(i: int, value: Any) -> None:
        for key, writer in writers:
            writer(i, value[key])

    return write


@make_writer.register(spaces.Tuple)
def _write_tuple(space: spaces.Tuple[Any], batch: Any) -> Writer:
    if isinstance(batch, ObjectRows):
        return _stored_whole(space, batch)
    writers = [make_writer(sub, part) for sub, part in zip(space.spaces, batch, strict=True)]

    def write(i: int, value: Any) -> None:
        for writer, item in zip(writers, value, strict=True):
            writer(i, item)

    return write


@singledispatch
def make_reader(space: spaces.Space[Any], batch: Any) -> Reader:
    """Return ``read(i)`` giving row ``i`` of ``batch`` as one env's value."""
    if isinstance(batch, ObjectRows):
        return batch.__getitem__
    raise TypeError(f"no row reader for space {space}")


@make_reader.register(spaces.Box)
@make_reader.register(spaces.Discrete)
@make_reader.register(spaces.MultiDiscrete)
@make_reader.register(spaces.MultiBinary)
def _read_array(space: spaces.Space[Any], batch: Any) -> Reader:
    if isinstance(batch, ObjectRows) or batch.ndim == 1:  # a scalar per env: a copy already
        read: Reader = batch.__getitem__
        return read
    # A copy of the row, not a view: an env that keeps its action (to penalise the next one's
    # change, say) must not see the next step's actions written over it.
    return lambda i: batch[i].copy()


@make_reader.register(spaces.Dict)
def _read_dict(space: spaces.Dict, batch: Any) -> Reader:
    if isinstance(batch, ObjectRows):
        return batch.__getitem__
    readers = [(key, make_reader(sub, batch[key])) for key, sub in space.spaces.items()]
    return lambda i: {key: reader(i) for key, reader in readers}


@make_reader.register(spaces.Tuple)
def _read_tuple(space: spaces.Tuple[Any], batch: Any) -> Reader:
    if isinstance(batch, ObjectRows):
        return batch.__getitem__
    readers = [make_reader(sub, part) for sub, part in zip(space.spaces, batch, strict=True)]
    return lambda i: tuple(reader(i) for reader in readers)
