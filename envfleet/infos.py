"""Per-env infos merged into one batch of infos, as Gymnasium's vector envs return them.

Each env's info dict becomes arrays over the batch, with a ``_key`` mask saying which envs set
``key`` (Gymnasium's ``VectorEnv._add_info``), for a batch of any size and in any order: async
batches hold whichever envs were ready. Infos that every env fills with the same plain scalars
(Atari's lives and frame numbers, say) take a faster path, one array per key at once.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from envfleet.info_columns import SCALARS, Columns, Layout, info_dict, layout_of, record_dtype


def merge_infos(pairs: list[tuple[dict[str, Any] | None, int]], size: int) -> dict[str, Any]:
    """The batch of infos of ``size`` envs from ``(info, position in the batch)`` pairs."""
    if len(pairs) == size and _uniform_scalars([info for info, _ in pairs]):
        return _stack_scalar_infos(pairs, size)
    infos: dict[str, Any] = {}
    for info, position in pairs:
        if info:
            _add_info(infos, info, position, size)
    return infos


def _uniform_scalars(infos: list[dict[str, Any] | None]) -> bool:
    """Every env has an info with the same keys, in the same order, each a plain scalar of the
    same type as in the others (Atari's, for instance)."""
    first = infos[0]
    if not first:
        return False
    types = tuple(map(type, first.values()))
    if not all(kind in SCALARS or issubclass(kind, np.number) for kind in types):
        return False
    keys = tuple(first)
    for info in infos:  # C loops: no Python per key
        if not info or tuple(info) != keys or tuple(map(type, info.values())) != types:
            return False
    return True


def _stack_scalar_infos(pairs: list[tuple[Any, int]], size: int) -> dict[str, Any]:
    """What :func:`_add_info` builds for uniform scalar infos, one array per key at once."""
    positions = [position for _, position in pairs]
    if positions == sorted(positions):
        ordered = [info for info, _ in pairs]
    else:
        ordered = [pairs[k][0] for k in np.argsort(positions, kind="stable")]
    infos: dict[str, Any] = {}
    for key, value in ordered[0].items():
        infos[key] = np.array(list(map(itemgetter(key), ordered)), dtype=type(value))
        infos[f"_{key}"] = np.ones(size, dtype=np.bool_)
    return infos


def _add_info(infos: dict[str, Any], info: dict[str, Any], index: int, size: int) -> None:
    """Gymnasium's ``VectorEnv._add_info`` for a batch of ``size`` (async batches differ)."""
    for key, value in info.items():
        if key == "final_obs":
            array = infos.get(key)
            if array is None:
                array = np.full(size, fill_value=None, dtype=object)
            array[index] = value
        elif isinstance(value, dict):
            array = infos.get(key, {})
            _add_info(array, value, index, size)
        else:
            array = infos.get(key)
            if array is None:
                if type(value) in (int, float, bool) or issubclass(type(value), np.number):
                    array = np.zeros(size, dtype=type(value))
                elif isinstance(value, np.ndarray):
                    array = np.zeros((size, *value.shape), dtype=value.dtype)
                else:
                    array = np.full(size, fill_value=None, dtype=object)
            array[index] = value
        mask = infos.get(f"_{key}")
        if mask is None:
            mask = np.zeros(size, dtype=np.bool_)
        mask[index] = True
        infos[key], infos[f"_{key}"] = array, mask


class InfoTable:
    """The pool's side: the column infos of ready envs (:func:`info_columns`) until handed out.

    One record per env in a structured array of the current layout (keys and their types);
    infos of another layout turn the records still waiting back into dicts first (rare: keys
    that change between steps).
    """

    def __init__(self, num_envs: int) -> None:
        self._num_envs = num_envs
        self._layout: Layout | None = None
        self._blob = b""
        self._records: np.ndarray[Any, np.dtype[Any]] = np.zeros(0)
        self._bytes = np.zeros((0, 0), dtype=np.uint8)  # the records' bytes, one row per env
        self._has = np.zeros(num_envs, dtype=np.bool_)
        self._true = np.ones(num_envs, dtype=np.bool_)  # never written: masks are its copies
        # The flags' bytes and all-True bytes: copied in by slices, compared for has.all().
        self._has_bytes = self._has.view(np.uint8).data
        self._all_bytes = self._true.view(np.uint8).data
        self._memory = memoryview(b"")  # the records' bytes, flat
        self._size = 0  # bytes per record
        self._fields: tuple[tuple[Any, str, np.ndarray], ...] = ()  # (key, "_key", its column)
        self._dicts: dict[int, dict[Any, Any]] = {}  # records of an earlier layout
        self._index: dict[tuple[int, ...], slice | np.ndarray] = {}
        self.pending = False
        """Some env's infos may be here (cleared once none is)."""

    def put(self, columns: Columns) -> None:
        """Take in one reply's columns (what :func:`info_columns` made)."""
        env_ids, blob, data = columns
        if blob != self._blob:
            self._relayout(layout_of(blob))
            self._blob = blob
        index = self._index.get(env_ids)
        if index is None:
            if len(self._index) > 1024:
                self._index.clear()
            index = self._index[env_ids] = _rows(env_ids)
        if type(index) is slice:  # a worker's block of envs: two copies of bytes, no numpy
            size = self._size
            self._memory[index.start * size : index.stop * size] = data
            self._has_bytes[index] = self._all_bytes[: index.stop - index.start]
        else:
            bytes_ = self._bytes
            bytes_[index] = np.frombuffer(data, dtype=np.uint8).reshape(-1, bytes_.shape[1])
            self._has[index] = True
        if self._dicts:
            for i in env_ids:
                self._dicts.pop(i, None)
        self.pending = True

    def take(
        self,
        env_ids: np.ndarray,
        positions: np.ndarray | None,
        size: int,
        pairs: list[tuple[dict[str, Any] | None, int]] | None,
        whole: bool = False,
    ) -> dict[str, Any]:
        """The infos of ``env_ids`` (handed over once), each at its position in a batch of
        ``size`` (``positions`` ``None``: in order from 0), merged with ``pairs``, the envs'
        dict infos (:func:`merge_infos`); ``whole``: ``env_ids`` are every env, in order."""
        has = self._has
        if pairs is not None and not any(info for info, _ in pairs):
            pairs = None
        if pairs is None and not self._dicts and len(env_ids) == size:
            if whole:
                if self._has_bytes == self._all_bytes:  # has.all(), without numpy's Python
                    return self._stack(env_ids, None, size, whole=True)
            elif has[env_ids].all():
                return self._stack(env_ids, positions, size)
        own = [self._pop(int(i)) for i in env_ids]
        if not self._dicts and not has.any():
            self.pending = False
        places = range(len(env_ids)) if positions is None else positions.tolist()
        if pairs is not None:  # an env has a dict or a record, never both
            own = [mine or theirs for mine, (theirs, _) in zip(own, pairs, strict=True)]
        return merge_infos(list(zip(own, places, strict=True)), size)

    def _stack(
        self, env_ids: np.ndarray, positions: np.ndarray | None, size: int, whole: bool = False
    ) -> dict[str, Any]:
        """Every env of a batch has a record: one column and one mask per key."""
        assert self._layout is not None
        if whole:  # every env, in order
            self._has.fill(False)
            self.pending = False
        else:
            self._has[env_ids] = False
        infos: dict[str, Any] = {}
        if positions is None:
            # Masks: copies of a kept all-True row (np.ones runs Python-level numpy).
            true = self._true if whole else self._true[:size]
            for key, mask, column in self._fields:
                # A contiguous copy either way (fancy indexing copies).
                infos[key] = column.copy() if whole else column[env_ids]
                infos[mask] = true.copy()
            return infos
        for key, mask, column in self._fields:
            values = infos[key] = np.zeros(size, dtype=column.dtype)
            values[positions] = column[env_ids]
            flags = infos[mask] = np.zeros(size, dtype=np.bool_)
            flags[positions] = True
        return infos

    def _pop(self, i: int) -> dict[str, Any] | None:
        """Env ``i``'s infos as the dict it sent (``None``: none here), handed over."""
        if self._dicts:
            info = self._dicts.pop(i, None)
            if info is not None:
                return info
        if not self._has[i]:
            return None
        self._has[i] = False
        assert self._layout is not None
        return info_dict(*self._layout, self._records[i])

    def _relayout(self, layout: Layout) -> None:
        """Switch to ``layout``: the records waiting become dicts."""
        if self._layout is not None:
            for i in np.flatnonzero(self._has).tolist():
                info = self._pop(i)
                assert info is not None
                self._dicts[i] = info
        self._layout = layout
        self._records = np.zeros(self._num_envs, dtype=record_dtype(layout[1]))
        self._bytes = self._records.view(np.uint8).reshape(self._num_envs, -1)
        self._memory = self._records.view(np.uint8).data
        self._size = self._records.dtype.itemsize
        self._fields = tuple(
            (key, f"_{key}", self._records[f"f{k}"]) for k, key in enumerate(layout[0])
        )


def _rows(env_ids: tuple[int, ...]) -> slice | np.ndarray:
    """Rows ``env_ids`` of a per-env array: a slice when they are consecutive, in order."""
    first = env_ids[0]
    if env_ids == tuple(range(first, first + len(env_ids))):
        return slice(first, first + len(env_ids))
    return np.array(env_ids, dtype=np.intp)


__all__ = ["InfoTable", "merge_infos"]
