"""Infos as columns: what a worker process sends when every env's info is plain scalars.

Atari's lives and frame numbers every step, MuJoCo's reward terms: per-env infos cost more
than the frames. A reply's infos of plain scalars travel as :data:`Columns`::

    worker: {env: {key: scalar}} ── info_columns ──► (env ids, layout: the keys and their types
                                                    pickled once, one record per env as bytes
                                                    packed by one cached ``struct.Struct``)
    hosted VectorEnv: its arrays ── BatchedInfos.columns ──► the same, with no Python per env
    pool:   InfoTable.put (:mod:`envfleet.infos`) ──► the records' bytes into a structured
            array; InfoTable.take ──► per key: the column (a copy) and an all-True mask, as
            Gymnasium's ``_add_info`` builds them; any other mix (envs with no info, other
            keys, dict infos) goes through :func:`~envfleet.infos.merge_infos` with the
            records turned back into the very values sent (:func:`column_dicts`).
"""

from __future__ import annotations

import functools
import pickle
import struct
from collections.abc import Iterator, Mapping
from operator import itemgetter
from typing import Any

import numpy as np

SCALARS = (int, float, bool)
"""The Python types an info's plain scalar may be (else a numpy number)."""


@functools.cache
def _plain(kind: type) -> bool:
    """Whether ``_add_info`` stores values of type ``kind`` in an array of that dtype (a
    timedelta's unit is not in its type: those go as dicts)."""
    return kind in SCALARS or (issubclass(kind, np.number) and not issubclass(kind, np.timedelta64))


_RECORDS: dict[tuple[type, ...], np.dtype[Any]] = {}


def record_dtype(types: tuple[type, ...]) -> np.dtype[Any]:
    """One env's info as a record: one field per key, of the dtype ``_add_info`` would use."""
    dtype = _RECORDS.get(types)
    if dtype is None:
        dtype = np.dtype([(f"f{k}", np.dtype(kind)) for k, kind in enumerate(types)])
        _RECORDS[types] = dtype
    return dtype


Columns = tuple[tuple[int, ...], bytes, bytes]
"""The infos of some envs as columns: their env ids, their layout (the keys and each key's
type, pickled: :func:`layout_of`), and one record per env (:func:`record_dtype`) as bytes."""

Layout = tuple[tuple[Any, ...], tuple[type, ...]]
_PICKLED: dict[Layout, bytes] = {}
_LAYOUTS: dict[bytes, Layout] = {}


def _pickled(layout: Layout) -> bytes:
    """``layout`` pickled, once (every step of an env sends the same one)."""
    blob = _PICKLED.get(layout)
    if blob is None:
        if len(_PICKLED) > 256:
            _PICKLED.clear()
        blob = _PICKLED[layout] = pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)
    return blob


def layout_of(blob: bytes) -> Layout:
    """The layout pickled in ``blob``, unpickled once."""
    layout = _LAYOUTS.get(blob)
    if layout is None:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        layout = _LAYOUTS[blob] = pickle.loads(blob)
    return layout


class _Packer:
    """How the infos of one layout become records' bytes: with ``struct`` when every type has
    an exact struct code (Python and numpy ints, Python floats, ``np.float64``, Python bools),
    else through a numpy array."""

    def __init__(self, keys: tuple[Any, ...], types: tuple[type, ...]) -> None:
        self.width = len(keys)
        self.get = itemgetter(*keys)
        self.blob = _pickled((keys, types))
        self.dtype = record_dtype(types)
        codes = [_CODES.get((field.kind, field.itemsize)) for field in map(np.dtype, types)]
        known = [code for code in codes if code is not None]
        self.code = "".join(known) if len(known) == len(codes) else None
        self._structs: dict[int, struct.Struct] = {}

    def pack(self, values: list[Any], count: int) -> bytes:
        """``values`` (``count`` records, flattened) as the records' bytes; ``ValueError`` or
        ``OverflowError`` when one does not fit its field (an int past int64)."""
        if self.code is None:
            width = self.width
            rows = [tuple(values[k : k + width]) for k in range(0, len(values), width)]
            return np.array(rows, dtype=self.dtype).tobytes()
        packer = self._structs.get(count)
        if packer is None:
            packer = self._structs[count] = struct.Struct("=" + self.code * count)
        try:
            return packer.pack(*values)
        except struct.error as exc:
            raise OverflowError(str(exc)) from exc


_CODES = {
    ("b", 1): "?",
    **{("i", size): code for size, code in ((1, "b"), (2, "h"), (4, "i"), (8, "q"))},
    **{("u", size): code for size, code in ((1, "B"), (2, "H"), (4, "I"), (8, "Q"))},
    ("f", 8): "d",
}
"""The struct code of each numpy (kind, size) whose values struct packs bit for bit as numpy
stores them: not float16/float32 (struct goes through a Python float, which quiets a signalling
NaN), nor complex or longdouble."""


_PACKERS: dict[tuple[tuple[Any, ...], tuple[type, ...]], _Packer] = {}


def info_columns(infos: Mapping[int, dict[str, Any]]) -> Columns | None:
    """The non-empty ``infos`` of one reply as columns, or ``None`` when they are not
    all the same keys, in the same order, each a plain scalar of one type per key (those go as
    dicts: merged env by env, they give what ``_add_info`` gives, errors included)."""
    if isinstance(infos, BatchedInfos):
        return infos.columns()
    first = next(iter(infos.values()))
    keys = tuple(first)
    types = tuple(map(type, first.values()))
    packer = _PACKERS.get((keys, types))
    if packer is None:
        if not keys or "final_obs" in keys:  # an object array in Gymnasium, whatever its value
            return None
        if not all(map(_plain, types)):
            return None
        if len(_PACKERS) > 256:
            _PACKERS.clear()
        packer = _PACKERS[keys, types] = _Packer(keys, types)
    get = packer.get
    dicts = infos.values()
    for info in dicts:
        if tuple(info) != keys:
            return None
    if packer.width == 1:
        values = list(map(get, dicts))
    else:
        values = [value for info in dicts for value in get(info)]
    if list(map(type, values)) != list(types) * len(infos):
        return None
    try:
        data = packer.pack(values, len(infos))
    except (OverflowError, ValueError, TypeError):  # an int past int64: _add_info raises it
        return None
    return tuple(infos), packer.blob, data


def unmasked_arrays(infos: Mapping[str, Any]) -> list[tuple[str, Any]] | None:
    """A VectorEnv's infos' keys and values when each value is an array with no ``_key`` mask
    (every env has it: Atari's lives and frame numbers); ``None`` otherwise."""
    whole: list[tuple[str, Any]] = []
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        if type(value) is not np.ndarray or "_" + key in infos:
            return None
        whole.append((key, value))
    return whole


class BatchedInfos(Mapping[int, dict[str, Any]]):
    """Infos of one step that every env fills alike, kept as one array per key: a hosted
    VectorEnv's (arrays with no ``_key`` mask: Atari's lives and frame numbers), or the dicts of
    a rollout's step of single envs (:meth:`of_dicts`). Read as a dict per env (what unbatching,
    or the dicts, gave: each value of the type it had), sent as columns (:meth:`columns`), and
    stacked into Gymnasium's batch (:meth:`stacked`), with no Python per env.

    Args:
        env_ids: the envs, in the arrays' order.
        keys: the infos' keys, in their order.
        arrays: one array per key, ``len(env_ids)`` values each (copied unless ``copy`` is
            false: a VectorEnv may write the next step's into the same arrays).
        types: each key's values' type (a Python scalar type, read back as one); by default
            the arrays' numpy types.
    """

    __slots__ = ("_arrays", "_at", "_types", "env_ids", "keys_")

    def __init__(
        self,
        env_ids: tuple[int, ...],
        keys: tuple[str, ...],
        arrays: list[np.ndarray],
        copy: bool = True,
        types: tuple[type, ...] | None = None,
    ) -> None:
        self.env_ids, self.keys_ = env_ids, keys
        self._arrays = [np.array(array, copy=True) for array in arrays] if copy else arrays
        self._types = types or tuple(array.dtype.type for array in self._arrays)
        self._at: dict[int, int] | None = None

    @staticmethod
    def of(env_ids: tuple[int, ...], infos: Mapping[str, Any]) -> BatchedInfos | None:
        """``infos`` (a VectorEnv's, over ``env_ids``) kept as arrays, where each key's value
        is an array of one value per env, of a plain scalar dtype, with no ``_key`` mask;
        else ``None`` (they are unbatched env by env)."""
        whole = unmasked_arrays(infos)
        if not whole:
            return None
        for key, value in whole:
            if value.shape != (len(env_ids),) or key == "final_obs" or not _plain(value.dtype.type):
                return None
        keys, arrays = zip(*whole, strict=True)
        return BatchedInfos(env_ids, keys, list(arrays))

    @staticmethod
    def of_dicts(infos: Mapping[int, dict[str, Any]]) -> BatchedInfos | None:
        """Envs' dicts kept as arrays where :func:`info_columns` takes them as columns (the
        same keys, each a plain scalar of one type); else ``None``."""
        columns = info_columns(infos)
        if columns is None:
            return None
        env_ids, (keys, types), records = _decoded(columns)
        arrays = [records[f"f{k}"] for k in range(len(keys))]
        return BatchedInfos(env_ids, keys, arrays, copy=False, types=types)

    @staticmethod
    def join(parts: list[BatchedInfos]) -> BatchedInfos | None:
        """``parts`` (of other envs each) as one, where they have the same keys and types."""
        first = parts[0]
        if len(parts) == 1:
            return first
        for part in parts[1:]:
            if part.keys_ != first.keys_ or part._types != first._types:
                return None
        env_ids = tuple(i for part in parts for i in part.env_ids)
        count = range(len(first.keys_))
        columns = [np.concatenate([p._arrays[k] for p in parts]) for k in count]
        return BatchedInfos(env_ids, first.keys_, columns, copy=False, types=first._types)

    def relabelled(self, env_ids: tuple[int, ...]) -> BatchedInfos:
        """The same infos under other ids (a rollout's columns), in the same order."""
        return BatchedInfos(env_ids, self.keys_, self._arrays, copy=False, types=self._types)

    def stacked(self, size: int) -> dict[str, Any] | None:
        """Gymnasium's batch of these infos when they are envs ``0 .. size - 1`` in order
        (a column and an all-True mask per key, as merging the dicts would give); else
        ``None``."""
        if self.env_ids != tuple(range(size)):
            return None
        infos: dict[str, Any] = {}
        for key, array, kind in zip(self.keys_, self._arrays, self._types, strict=True):
            infos[key] = array.astype(kind)  # a copy, of the dtype merging gives
            infos[f"_{key}"] = np.ones(size, dtype=np.bool_)
        return infos

    def columns(self) -> Columns:
        """The infos as :func:`info_columns` makes them of the dicts: one record per env."""
        types = self._types
        records = np.empty(len(self.env_ids), dtype=record_dtype(types))
        for k, array in enumerate(self._arrays):
            records[f"f{k}"] = array
        return self.env_ids, _pickled((self.keys_, types)), records.tobytes()

    def __getitem__(self, env: int) -> dict[str, Any]:
        if self._at is None:
            self._at = {i: j for j, i in enumerate(self.env_ids)}
        j = self._at[env]
        return info_dict(self.keys_, self._types, [array[j] for array in self._arrays])

    def __iter__(self) -> Iterator[int]:
        return iter(self.env_ids)

    def __len__(self) -> int:
        return len(self.env_ids)

    def __reduce__(self) -> tuple[Any, ...]:
        return BatchedInfos, (self.env_ids, self.keys_, self._arrays, False, self._types)


def column_dicts(columns: Columns) -> dict[int, dict[str, Any]]:
    """``columns`` turned back into the dicts :func:`info_columns` took them from."""
    env_ids, (keys, types), records = _decoded(columns)
    return {i: info_dict(keys, types, record) for i, record in zip(env_ids, records, strict=True)}


def _decoded(columns: Columns) -> tuple[tuple[int, ...], Layout, np.ndarray]:
    """``columns`` read: their env ids, their layout, and their records (a view of the bytes)."""
    env_ids, blob, data = columns
    layout = layout_of(blob)
    return env_ids, layout, np.frombuffer(data, dtype=record_dtype(layout[1]))


def info_dict(keys: tuple[Any, ...], types: tuple[type, ...], record: Any) -> dict[str, Any]:
    """One record as the info it was: plain Python scalars stay Python scalars."""
    return {
        key: record[k].item() if kind in SCALARS else record[k]
        for k, (key, kind) in enumerate(zip(keys, types, strict=True))
    }


__all__ = [
    "SCALARS",
    "BatchedInfos",
    "Columns",
    "Layout",
    "column_dicts",
    "info_columns",
    "info_dict",
    "layout_of",
    "record_dtype",
    "unmasked_arrays",
]
