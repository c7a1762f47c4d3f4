"""The worker's group when it hosts VectorEnvs: one or more blocks of consecutive envs, each
stepped with one call of its VectorEnv (see :mod:`envfleet.hosted`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import concatenate, create_empty_array

from envfleet.buffers import Batch, fits_dtype, put, take
from envfleet.errors import OnError, Phase
from envfleet.group_envs import derive_seed
from envfleet.guards import env_errors
from envfleet.hosted.batches import (
    block_views,
    call_venvs,
    leaves,
    row,
    sends,
    set_venvs,
    span,
    step_infos,
    take_infos,
    unbatch_infos,
)
from envfleet.hosted.block import Block
from envfleet.hosted.recipe import RESTARTED, HostedRecipe
from envfleet.info_columns import BatchedInfos
from envfleet.protocol import EnvFailure, Reply


class HostedGroup:
    """The worker's group when it hosts VectorEnvs: one or more blocks of consecutive envs,
    each stepped with one call of its VectorEnv (the :class:`~envfleet.protocol.Group` a
    worker serves, as :class:`~envfleet.group.EnvGroup` is for single envs)."""

    def __init__(
        self,
        recipe: HostedRecipe,
        env_ids: Sequence[int],
        batch: Batch,
        autoreset_mode: AutoresetMode,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        on_error: OnError = OnError.RAISE,
        seed_base: int | None = None,
        restarts: Mapping[int, int] | None = None,
        restarted: bool = False,
    ) -> None:
        self.recipe = recipe
        self.batch = batch
        self.mode = autoreset_mode
        self.observation_space = observation_space
        self.action_space = action_space
        self.on_error = on_error
        self.seed_base = seed_base
        self.blocks: list[Block] = []
        ids = list(env_ids)
        try:
            while ids:
                b = recipe.block_of(ids[0])
                start, size = recipe.blocks[b]
                block_ids = tuple(range(start, start + size))
                if tuple(ids[:size]) != block_ids:
                    raise ValueError(
                        f"a worker hosting VectorEnvs holds whole blocks; envs {ids[:size]} "
                        f"are not block {b} ({block_ids})"
                    )
                count = max(((restarts or {}).get(i, 0) for i in block_ids), default=0)
                block = Block(b, block_ids, slice(start, start + size), self._build(b), count)
                block.views = block_views(batch, action_space, block.rows)
                block.owe_truncation = restarted
                self.blocks.append(block)
                ids = ids[size:]
        except BaseException:
            self.close()
            raise
        self._by_first = {block.ids[0]: block for block in self.blocks}
        self._last: tuple[Sequence[int] | None, list[Block]] = (None, [])

    def _build(self, b: int) -> VectorEnv[Any, Any, Any]:
        venv = self.recipe.build(b)
        mode = venv.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if AutoresetMode(mode) is not self.mode:
            venv.close()
            raise ValueError(
                f"the hosted VectorEnv's autoreset mode is {AutoresetMode(mode).value}, the "
                f"pool's {self.mode.value}: make the pool with autoreset_mode={mode!r}"
            )
        return venv

    def _blocks_of(self, env_ids: Sequence[int]) -> list[Block]:
        if env_ids is self._last[0]:  # the same command's ids every step
            return self._last[1]
        out, ids, at = [], tuple(env_ids), 0
        while at < len(ids):
            block = self._by_first.get(ids[at])
            size = 0 if block is None else len(block.ids)
            if block is None or ids[at : at + size] != block.ids:
                raise ValueError(
                    f"envs {list(env_ids)}: a hosted VectorEnv steps and resets its whole "
                    "block of envs at once (send whole blocks: a batch_size that is a "
                    "multiple of the envs per hosted VectorEnv)"
                )
            out.append(block)
            at += size
        self._last = (env_ids, out)
        return out

    # -- the Group protocol --------------------------------------------------------------------

    def reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> Reply:
        """Reset ``env_ids`` (whole blocks; a subset of a block through ``reset_mask``)."""
        wanted = set(env_ids)
        seed_of = dict(zip(env_ids, seeds, strict=True))
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        for block in self.blocks:
            mine = [i for i in block.ids if i in wanted]
            if not mine:
                continue
            opts = dict(options or {})
            if len(mine) < len(block.ids):
                opts["reset_mask"] = np.isin(np.array(block.ids), mine)
            restarted = block.owe_truncation or block.owe_reset
            # A subset of a block is reset through its mask, with the hosted env's own seeds.
            seeds_here: list[int | None] = (
                [seed_of[i] for i in block.ids] if len(mine) == len(block.ids) else [None]
            )
            try:
                obs, info = block.reset(seeds_here, opts or None)
                self._write_obs(block, obs)
            except env_errors() as exc:
                failures.extend(EnvFailure.capture_all(block.ids, Phase.RESET, exc))
                continue
            block.owe_truncation = block.owe_reset = False
            rows = block.rows
            self.batch.terminations[rows] = False
            self.batch.truncations[rows] = False
            per_env = unbatch_infos(info, len(block.ids))
            for j, i in enumerate(block.ids):
                if i not in wanted:
                    continue
                env_info = per_env.get(j, {})
                if restarted:
                    env_info = {**env_info, RESTARTED: True}
                if env_info:
                    infos[i] = env_info
        return Reply(env_ids=tuple(env_ids), infos=infos or None, failures=tuple(failures))

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        """Step whole blocks with the actions in their batch rows (or ``actions``)."""
        infos: dict[int, Any] = {}
        batched: list[BatchedInfos] = []  # blocks' infos kept as their arrays (take_infos)
        failures: list[EnvFailure] = []
        recovered: list[EnvFailure] = []
        kept: list[int] = []
        blocks = self._blocks_of(env_ids)
        sent = self._send_all(blocks, actions)
        for block in blocks:
            if block.owe_truncation:  # rebuilt: the interrupted episodes end here
                self._report_truncated(block, infos, kept, failures)
                continue
            try:
                if block.owe_reset:  # the rebuilt env's first result: its reset
                    obs, info = block.reset(
                        [derive_seed(self.seed_base, i, block.restarts) for i in block.ids],
                        None,
                    )
                    block.owe_reset = False
                    self._write_step(block, obs, 0.0, False, False)
                elif block.index in sent:  # its actions are out: its results
                    error = sent[block.index]
                    if error is not None:
                        raise error
                    obs, rewards, terminations, truncations, info = cast(Any, block.venv).recv()
                    self._write_step(block, obs, rewards, terminations, truncations)
                else:
                    acts = self._actions(block, actions)
                    obs, rewards, terminations, truncations, info = block.venv.step(acts)
                    self._write_step(block, obs, rewards, terminations, truncations)
            except env_errors() as exc:
                self._broke(block, exc, infos, kept, failures, recovered)
                continue
            if info:
                take_infos(info, block.ids, infos, batched)
        return _reply(env_ids, infos, batched, failures, recovered, kept)

    def plain(self, env_ids: Sequence[int]) -> bool:
        """Whether a step of ``env_ids`` may go through :meth:`step_into`: one block, in
        NEXT_STEP mode (its VectorEnv resets its own envs), owing no reset or truncation since
        a rebuild, its observations one array."""
        blocks = self._blocks_of(env_ids)
        return (
            len(blocks) == 1
            and self.mode is AutoresetMode.NEXT_STEP
            and not (blocks[0].owe_truncation or blocks[0].owe_reset)
            and blocks[0].views[1] is not None
        )

    def step_into(
        self, env_ids: Sequence[int], actions: np.ndarray, current: np.ndarray, out: Sequence[Any]
    ) -> Reply | None:
        """A rollout's step of ``env_ids`` (:meth:`plain`) with ``actions``, its rows written
        into ``out`` (a record's observations, rewards and flags), not the batch's, which the
        caller brings up to date (``current``: the observations they would hold now); one that
        raises goes as :meth:`step`'s does, through the batch. ``None``: nothing to report."""
        block = self._blocks_of(env_ids)[0]
        try:
            obs, rewards, terminations, truncations, info = block.venv.step(actions)
            self._write_obs(block, obs, out[0])
            out[1][...], out[2][...], out[3][...] = rewards, terminations, truncations
        except env_errors() as exc:
            infos: dict[int, Any] = {}
            failures: list[EnvFailure] = []
            recovered: list[EnvFailure] = []
            kept: list[int] = []
            block.views[1][...] = current  # the rows as they stand, kept by a restart
            self._broke(block, exc, infos, kept, failures, recovered)
            for rows, into in zip(block.views[1:], out, strict=True):
                into[...] = rows
            return _reply(env_ids, infos, [], failures, recovered, kept)
        if not info:
            return None
        by_env: dict[int, Any] = {}
        batched: list[BatchedInfos] = []
        take_infos(info, block.ids, by_env, batched)
        return Reply(env_ids=tuple(env_ids), infos=step_infos(by_env, batched))

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """Call ``name`` on each hosted VectorEnv (:func:`~envfleet.hosted.batches.call_venvs`)."""
        return call_venvs([(b.ids, b.venv) for b in self.blocks], name, args, kwargs)

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        """Set ``name`` on each hosted VectorEnv (:func:`~envfleet.hosted.batches.set_venvs`)."""
        return set_venvs([(b.ids, b.venv) for b in self.blocks], name, values)

    def close(self) -> Reply:
        """Close every hosted VectorEnv."""
        for block in self.blocks:
            try:
                block.venv.close()
            except Exception:
                pass
        return Reply()

    # -- internals -----------------------------------------------------------------------------

    def _send_all(
        self, blocks: list[Block], carried: dict[int, Any] | None
    ) -> dict[int, BaseException | None]:
        """Where two or more blocks of this step host VectorEnvs with their own ``send`` and
        ``recv`` (ale-py's ``AtariVectorEnv``, EnvPool) stepping all their envs at once, each
        gets its actions before any is waited for, so that they step side by side on their
        own threads; ``step`` is ``send`` then ``recv`` for them. By block: ``None`` (sent) or
        the error its ``send`` raised (raised again where its ``step`` would have been)."""
        ready = [b for b in blocks if b.sends and not (b.owe_truncation or b.owe_reset)]
        if len(ready) < 2:
            return {}
        sent: dict[int, BaseException | None] = {}
        for block in ready:
            try:
                cast(Any, block.venv).send(self._actions(block, carried))
                sent[block.index] = None
            except env_errors() as exc:
                sent[block.index] = exc
        return sent

    def _actions(self, block: Block, carried: dict[int, Any] | None) -> Any:
        """The block's actions: a view of its rows of the batch, or the carried ones."""
        if carried is None:  # a view made once, or (actions that are no arrays) a slice
            view = block.views[0]
            return view if view is not None else self.batch.actions[block.rows]
        out: Any = create_empty_array(self.action_space, len(block.ids))
        return concatenate(self.action_space, [carried[i] for i in block.ids], out)

    def _write_step(
        self, block: Block, obs: Any, rewards: Any, terminations: Any, truncations: Any
    ) -> None:
        """A step's results of ``block`` into its rows of the batch."""
        self._write_obs(block, obs)
        _, _, *flags = block.views  # rewards, terminations, truncations
        for rows, values in zip(flags, (rewards, terminations, truncations), strict=True):
            rows[...] = values

    def _write_obs(self, block: Block, obs: Any, into: np.ndarray | None = None) -> None:
        """The block's observations into its rows (or ``into``, rows of one array), with one
        copy per field; a dtype that does not fit the space without an unsafe cast is refused,
        as ``SyncVectorEnv`` does."""
        rows = block.views[1] if into is None else into
        if rows is not None and type(obs) is np.ndarray and obs.dtype == rows.dtype:
            rows[...] = obs  # one array of the batch's dtype: nothing to check (the hot path)
            return
        for value, space in leaves(obs, self.observation_space):
            array = np.asarray(value)
            if not fits_dtype(array, np.dtype(space.dtype)):  # a leaf written in place has one
                raise TypeError(
                    f"Cannot cast observations of dtype {array.dtype} to the space's "
                    f"{space.dtype} according to the rule 'same_kind'"
                )
        if into is not None:
            into[...] = obs
            return
        put(self.observation_space, self.batch.observations, block.rows, obs)

    def _broke(
        self,
        block: Block,
        exc: BaseException,
        infos: dict[int, Any],
        kept: list[int],
        failures: list[EnvFailure],
        recovered: list[EnvFailure],
    ) -> None:
        """``block``'s VectorEnv raised ``exc`` stepping: its failure reported (``raise``), or
        the VectorEnv rebuilt and its envs' episodes reported truncated."""
        if self.on_error is OnError.RAISE:
            failures.extend(EnvFailure.capture_all(block.ids, Phase.STEP, exc))
            return
        self._rebuild(block, exc, recovered)
        self._report_truncated(block, infos, kept, failures)

    def _rebuild(self, block: Block, exc: BaseException, recovered: list[EnvFailure]) -> None:
        """Replace ``block``'s VectorEnv after it raised; each of its envs counts a restart."""
        try:
            block.venv.close()
        except Exception:
            pass
        recovered.extend(EnvFailure.capture_all(block.ids, Phase.STEP, exc))
        block.restarts += 1
        block.venv = self._build(block.index)
        block.sends = sends(block.venv)
        block.owe_truncation = True

    def _report_truncated(
        self,
        block: Block,
        infos: dict[int, Any],
        kept: list[int],
        failures: list[EnvFailure],
    ) -> None:
        """The rebuilt block's interrupted episodes, reported truncated (reward 0). NEXT_STEP
        and DISABLED: their last observation kept, the next step (or the caller) resets it;
        SAME_STEP: reset now, the last observation in ``infos["final_obs"]``, as Gymnasium's
        vector envs end an episode in that mode."""
        rows = block.rows
        block.owe_truncation = False
        if self.mode is AutoresetMode.SAME_STEP:
            final = take(self.observation_space, self.batch.observations, np.arange(*span(rows)))
            seeds = [derive_seed(self.seed_base, i, block.restarts) for i in block.ids]
            try:
                obs, reset_info = block.reset(seeds, None)
                self._write_obs(block, obs)
            except env_errors() as exc:
                failures.extend(EnvFailure.capture_all(block.ids, Phase.RESET, exc))
                return
            per_env = unbatch_infos(reset_info, len(block.ids))
            for j, i in enumerate(block.ids):
                final_obs = row(final, j)
                infos[i] = {
                    "final_obs": final_obs,
                    "final_info": {},
                    **per_env.get(j, {}),
                    RESTARTED: True,
                }
        else:
            for i in block.ids:
                infos[i] = {RESTARTED: True}
            kept.extend(block.ids)
            block.owe_reset = self.mode is AutoresetMode.NEXT_STEP
        self.batch.rewards[rows] = 0.0
        self.batch.terminations[rows] = False
        self.batch.truncations[rows] = True


def _reply(
    env_ids: Sequence[int],
    infos: dict[int, Any],
    batched: list[BatchedInfos],
    failures: list[EnvFailure],
    recovered: list[EnvFailure],
    kept: list[int],
) -> Reply:
    """A step's reply: its infos, failures, restarts and the envs whose rows were kept."""
    return Reply(
        env_ids=tuple(env_ids),
        infos=step_infos(infos, batched),
        failures=tuple(failures),
        restarts=tuple(recovered),
        kept=tuple(kept),
    )


__all__ = ["HostedGroup"]
