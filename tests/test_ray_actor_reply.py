"""What a per-worker Ray actor's step reply carries to the pool
(:meth:`envfleet.backends.ray.actor.GroupActor.run`, read back by
:func:`~envfleet.backends.ray.actor.unpack`), without Ray: the actor's group is a stand-in whose
step reply the test chooses, its batch a local one with known rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from envfleet.backends.ray.actor import GroupActor, unpack
from envfleet.buffers import Batch
from envfleet.errors import Phase
from envfleet.protocol import EnvFailure, Reply, Step

OBS = spaces.Box(-10.0, 10.0, shape=(2,), dtype=np.float32)
ENVS = 3


class ScriptedGroup:
    """A group whose step answers with the reply it is given."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    def step(self, env_ids: tuple[int, ...], actions: Any = None) -> Reply:
        return self.reply


def actor_answering(reply: Reply) -> GroupActor:
    """A :class:`GroupActor` (not started as a Ray actor) whose group answers ``reply``, its
    batch's rows holding env ``i``'s observation ``(i, -i)``, reward ``10 i``, env 2 truncated."""
    actor = GroupActor.__new__(GroupActor)
    actor.options = SimpleNamespace(observation_space=OBS)  # type: ignore[assignment]
    actor.batch = Batch.local(OBS, spaces.Discrete(2), ENVS)
    for i in range(ENVS):
        actor.batch.observations[i] = (i, -i)
        actor.batch.rewards[i] = 10 * i
    actor.batch.truncations[2] = True
    actor.group = ScriptedGroup(reply)  # type: ignore[assignment]
    return actor


def failure() -> EnvFailure:
    return EnvFailure.capture(1, Phase.STEP, RuntimeError("boom"))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"infos": {1: {"a": 1}}},
        {"kept": (1,)},
        {"kept": (1,), "infos": {1: {"envfleet/restarted": True}}},
        {"restarts": "one"},
        {"failures": "one"},
    ],
    ids=["plain", "infos", "kept", "kept-infos", "restarts", "failures"],
)
def test_a_step_reply_reaches_the_pool_with_its_rows_and_all_it_says(extra: dict[str, Any]) -> None:
    """Whatever the reply says beside its rows and infos (failures, restarts, the envs whose
    rows the pool keeps: a restarted env's latest observation) reaches the pool as the group
    said it; the rows are the batch's (but a failed env's), whether the reply travels whole or
    as a bare tuple."""
    said: dict[str, Any] = {k: (failure(),) if v == "one" else v for k, v in extra.items()}
    reply = Reply(env_ids=(1, 2), **said)
    got = unpack(actor_answering(reply).run(Step((1, 2))))
    assert got.env_ids == (1, 2)
    assert got.kept == reply.kept and got.restarts == reply.restarts
    assert got.failures == reply.failures and got.infos == reply.infos
    assert got.rows is not None
    rows = [2] if reply.failures else [1, 2]  # a failed env's row does not travel
    np.testing.assert_array_equal(got.rows.env_ids, rows)
    np.testing.assert_array_equal(got.rows.observations, [[i, -i] for i in rows])
    np.testing.assert_array_equal(got.rows.rewards, [10 * i for i in rows])
    np.testing.assert_array_equal(got.rows.truncations, [i == 2 for i in rows])
