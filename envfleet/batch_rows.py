"""The rows one step command's envs own in the batch arrays, written at once.

The hot path of :class:`~envfleet.group.EnvGroup` (issue 23): a group collects every env's
``(obs, reward, terminated, truncated, info)`` and writes them here with one assignment per
field, as ``SyncVectorEnv`` does. A step command names the same envs every step, so their rows
(a slice when the env ids are consecutive) and a view of each field over them are made once and
kept by the group; nothing is allocated per env but the env's own result::

    results ─ zip ─► observations ── one assignment, shapes checked ► rows (small rows)
                                 └── row by row, no temporary ───► rows (frames)
                     rewards, terminated, truncated ─────────────► one assignment each
                     infos ──────────────────────────────────────► to the group (non-empty ones)

A result that does not fit (another length than five, an observation of another shape, or of
a dtype numpy's ``same_kind`` rule does not cast into the rows') is reported, not written: the
group then writes env by env, so that the failure names its env.

The other way, a rollout's loop copies its part's rows out of the batch every step
(:class:`BlockRows`), from views made once over the same rows (:func:`row_index`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envfleet.buffers import Batch, fits_dtype

SMALL_ROW_BYTES = 1024
"""Observation rows up to this size are gathered into one array and written at once; larger
ones (frames) are copied into their rows one by one, with no temporary array."""

Written = tuple[bool, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]
"""What :meth:`BatchRows.write` wrote: whether an episode ended, then the terminated and
truncated flags and the infos, one per env."""


def row_index(env_ids: Sequence[int] | np.ndarray) -> slice | np.ndarray:
    """Rows ``env_ids`` (ids, or an index array) of a batch array: a slice when they are
    consecutive, in order (a worker's block, as a rule: its rows are then views), else an index
    array."""
    count = len(env_ids)
    if not count:
        return slice(0, 0)
    first, last = int(env_ids[0]), int(env_ids[-1])
    if last - first + 1 == count:
        if isinstance(env_ids, np.ndarray):
            consecutive = count < 3 or bool((np.diff(env_ids) == 1).all())
        else:
            consecutive = tuple(env_ids) == tuple(range(first, last + 1))
        if consecutive:
            return slice(first, last + 1)
    return np.asarray(env_ids, dtype=np.intp)


class BlockRows:
    """A per-env array's rows ``rows`` (:func:`row_index`), copied out again and again: from a
    view made once where they are a slice, else gathered."""

    __slots__ = ("index", "source", "view")

    def __init__(self, source: np.ndarray, rows: slice | np.ndarray) -> None:
        self.source = source
        self.index = rows if isinstance(rows, np.ndarray) else None
        self.view = source[rows] if self.index is None else source[:0]

    def into(self, out: np.ndarray) -> None:
        """The rows as they stand now, into ``out``."""
        if self.index is None:
            out[...] = self.view
        else:
            np.take(self.source, self.index, axis=0, out=out, mode="clip")


class _Scattered:
    """Rows of an array picked by an index array (not a view): written through the array."""

    def __init__(self, array: np.ndarray, index: np.ndarray) -> None:
        self.array, self.index = array, index

    def __setitem__(self, _: Any, value: Any) -> None:
        self.array[self.index] = value

    def fill(self, value: Any) -> None:
        self.array[self.index] = value


class BatchRows:
    """The rows of ``env_ids`` in ``batch`` (their envs alongside), and what writes them.

    Args:
        batch: the arrays of the whole pool.
        env_ids: global indices of the envs, in the order of their results.
        envs: the envs themselves, in the same order.
    """

    def __init__(self, batch: Batch, env_ids: Sequence[int], envs: list[Any]) -> None:
        self.env_ids = env_ids
        self.envs = envs
        self.index = index = row_index(env_ids)
        obs = batch.observations
        small = isinstance(obs, np.ndarray) and obs[:1].nbytes <= SMALL_ROW_BYTES
        self.row_shape = obs.shape[1:] if small else None
        """The shape of one observation gathered into the rows at once; None: written row by
        row."""
        self.row_dtype: Any = _canonical(obs.dtype) if small else None
        """The dtype of the rows gathered at once: an observation of another one is checked
        before anything is written (:func:`~envfleet.buffers.fits_dtype`). numpy's own
        object for it, so that the identity tests of :meth:`_dtypes_fit` hold for a dtype
        that came unpickled (a node's batch): they failed on every step there, and every
        observation was checked one by one."""

        def rows(array: np.ndarray) -> Any:
            return array[index] if isinstance(index, slice) else _Scattered(array, index)

        self._targets: tuple[Any, Any, Any, Any] = (
            rows(obs) if small else None,
            rows(batch.rewards),
            rows(batch.terminations),
            rows(batch.truncations),
        )
        self.flags_clear = False
        """Whether every terminated and truncated flag of these rows is False as written last
        (then an ongoing step writes neither); whoever writes a flag of these rows by another
        way sets it False (:class:`~envfleet.group.EnvGroup`, env by env)."""
        self._actions = batch.actions[index] if isinstance(index, slice) else None
        self.action_view: np.ndarray | None = (
            self._actions if self._actions is not None and self._actions.ndim == 1 else None
        )
        """The actions in these rows, when :meth:`actions` would return this same view every
        step (scalar actions in consecutive rows): the hot path reads it with no call."""
        self._batch = batch

    def actions(self) -> np.ndarray:
        """The actions in these rows; a copy when each is an array (an env that keeps its
        action must not see the next step's actions written over it)."""
        actions: np.ndarray = (
            self._batch.actions[self.index] if self._actions is None else self._actions
        )
        return actions.copy() if actions.ndim > 1 else actions

    def _dtypes_fit(self, observations: tuple[Any, ...]) -> bool:
        """Whether every observation goes into the rows as Gymnasium would write it
        (:func:`~envfleet.buffers.fits_dtype`); when they all have the rows' dtype, at the
        cost of one ``np.result_type`` (arrays) or one identity test each (scalars)."""
        row_dtype = self.row_dtype
        if self.row_shape:
            # Arrays (a Python scalar among them does not fit the rows' shape: numpy refuses
            # it when they are written). Their common dtype is the rows' only when each one
            # casts safely into it; anything else is looked at one by one.
            try:
                if np.result_type(*observations) is row_dtype:
                    return True
            except Exception:  # no common dtype (strings, objects): one by one
                pass
        else:
            try:
                for obs in observations:
                    if obs.dtype is not row_dtype and not fits_dtype(obs, row_dtype):
                        return False
                return True
            except AttributeError:  # Python scalars (no dtype): what numpy makes of each
                pass
        return all(fits_dtype(obs, row_dtype) for obs in observations)

    def write(self, results: list[Any], write_obs: Callable[[int, Any], None]) -> Written | None:
        """Write one result per env with one assignment per field; None, when a result does
        not fit, with the rows partly written (the caller writes them again, env by env).

        ``write_obs(i, obs)`` writes one env's observation (frames, structured spaces)."""
        n = len(results)
        if not n:
            return False, (), (), ()
        observations_rows, rewards_rows, terminations_rows, truncations_rows = self._targets
        try:
            # strict: a result of another length than the others' is refused (zip alone would
            # cut the longer ones short); the unpacking refuses any length but five.
            observations, rewards, terminations, truncations, infos = zip(*results, strict=True)
            row_shape = self.row_shape
            if row_shape is not None:
                # The first observation's shape is checked here; numpy refuses the others
                # (ValueError) unless they all have that shape: a batch of observations of one
                # other shape is never broadcast into the rows, a ragged one never written.
                # (Scalar rows need no check: nothing but scalars fits them.) No temporary
                # array: the observations go straight into their rows.
                if row_shape and getattr(observations[0], "shape", None) != row_shape:
                    return None
                # numpy's assignment casts whatever it is given (300.7 or nan into uint8): an
                # observation of another dtype is checked first, one identity test each when
                # the dtypes match (the common case), and refused as Gymnasium refuses it.
                if not self._dtypes_fit(observations):
                    return None
                observations_rows[...] = observations
            else:
                for i, obs in zip(self.env_ids, observations, strict=True):
                    write_obs(i, obs)
            rewards_rows[...] = rewards
            # Episodes that go on (the common case): one scalar instead of a tuple per flag,
            # and nothing at all when the flags are False already.
            if terminations.count(False) == n and truncations.count(False) == n:
                if not self.flags_clear:
                    terminations_rows.fill(False)
                    truncations_rows.fill(False)
                    self.flags_clear = True
                return False, terminations, truncations, infos
            self.flags_clear = False
            terminations_rows[...] = terminations
            truncations_rows[...] = truncations
        except Exception:
            return None
        return True, terminations, truncations, infos

    def write_and_book(
        self,
        results: list[Any],
        write_obs: Callable[[int, Any], None],
        reset_ids: list[int],
        owe_reset: set[int],
        infos: dict[int, Any],
    ) -> bool:
        """:meth:`write`, then the group's autoreset bookkeeping: the envs this step reset
        (``reset_ids``) leave ``owe_reset``, those whose episode ended join it, and the
        non-empty infos go into ``infos``; False, nothing booked, when a result does not fit
        (the group then writes env by env, so that the failure names its env)."""
        written = self.write(results, write_obs)
        if written is None:
            return False
        ended, terminations, truncations, env_infos = written
        env_ids = self.env_ids
        if reset_ids:
            owe_reset.difference_update(reset_ids)
        if ended:
            owe_reset.update(
                i for i, te, tr in zip(env_ids, terminations, truncations, strict=True) if te or tr
            )
        if any(env_infos):
            for i, info in zip(env_ids, env_infos, strict=True):
                if info:
                    infos[i] = info
        return True


def _canonical(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """numpy's own object for a plain ``dtype`` (``np.result_type`` and arrays' dtypes are
    those objects; an unpickled dtype is an equal copy); another dtype as it is."""
    if dtype.names is None and dtype.subdtype is None:
        same: np.dtype[Any] = np.dtype(dtype.str)
        if same == dtype:
            return same
    return dtype


__all__ = ["SMALL_ROW_BYTES", "BatchRows", "BlockRows", "Written", "row_index"]
