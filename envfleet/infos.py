"""Per-env infos merged into one batch of infos, as Gymnasium's vector envs return them.

Each env's info dict becomes arrays over the batch, with a ``_key`` mask saying which envs set
``key`` (Gymnasium's ``VectorEnv._add_info``), for a batch of any size and in any order: async
batches hold whichever envs were ready. Infos that every env fills with the same plain scalars
(Atari's lives and frame numbers, say) take a faster path, one array per key at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def merge_infos(pairs: list[tuple[dict[str, Any] | None, int]], size: int) -> dict[str, Any]:
    """The batch of infos of ``size`` envs from ``(info, position in the batch)`` pairs."""
    if len(pairs) == size and _uniform_scalars([info for info, _ in pairs]):
        return _stack_scalar_infos(pairs, size)
    infos: dict[str, Any] = {}
    for info, position in pairs:
        if info:
            _add_info(infos, info, position, size)
    return infos


_SCALARS = (int, float, bool)


def _uniform_scalars(infos: list[dict[str, Any] | None]) -> bool:
    """Every env has an info with the same keys, each a plain scalar (Atari's, for instance)."""
    first = infos[0]
    if not first:
        return False
    keys = first.keys()
    for info in infos:
        if not info or info.keys() != keys:
            return False
    return all(
        type(value) in _SCALARS or isinstance(value, np.number) for value in first.values()
    ) and all(type(info[k]) is type(first[k]) for info in infos for k in keys)  # type: ignore[index]


def _stack_scalar_infos(pairs: list[tuple[Any, int]], size: int) -> dict[str, Any]:
    """What :func:`_add_info` builds for uniform scalar infos, one array per key at once."""
    order = np.argsort([position for _, position in pairs], kind="stable")
    ordered = [pairs[k][0] for k in order]
    infos: dict[str, Any] = {}
    for key, value in ordered[0].items():
        infos[key] = np.array([info[key] for info in ordered], dtype=type(value))
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
