"""A rebuild that takes longer than ``step_timeout`` harms no healthy worker.

Worker 0's env dies mid-step and its replacement takes seconds to build; worker 1's reply
arrives meanwhile. The pool must read it before it judges anyone hung, and the rebuild's time
must not count against worker 1's ``step_timeout``: only the env that failed restarts, and
worker 1's env goes on exactly as ``SyncVectorEnv``'s.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium.vector import SyncVectorEnv

import envfleet

REBUILD_SECONDS = 2.5  # > STEP_TIMEOUT: a rebuild the old pool counted against worker 1
STEP_TIMEOUT = 1.0
DIE_AT = 3  # env 0's process exits on its 3rd step


class Dying(gymnasium.Wrapper[Any, Any, Any, Any]):
    """CartPole whose env 0 exits its process on step ``DIE_AT`` (once: a marker file says it
    did, and then every build of env 0 takes ``REBUILD_SECONDS``)."""

    def __init__(self, index: int, marker: str, dies: bool) -> None:
        if index == 0 and os.path.exists(marker):
            time.sleep(REBUILD_SECONDS)  # the replacement's slow build
        super().__init__(gymnasium.make("CartPole-v1"))
        self.index, self.marker, self.dies, self.steps = index, marker, dies, 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        dying = self.dies and self.index == 0 and self.steps == DIE_AT
        if dying and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(3)
        if self.index == 1:
            time.sleep(0.1)  # worker 1 answers while worker 0's replacement builds
        return self.env.step(action)


def build(index: int, marker: str, dies: bool) -> gymnasium.Env[Any, Any]:
    return Dying(index, marker, dies)


def test_a_slow_rebuild_restarts_only_the_env_that_failed(tmp_path: Path) -> None:
    marker = str(tmp_path / "died")
    fns = [functools.partial(build, i, marker, True) for i in range(2)]
    steps = 6
    actions = np.random.default_rng(0).integers(0, 2, size=(steps, 2))
    reference = SyncVectorEnv([functools.partial(build, i, marker, False) for i in range(2)])
    want = [reference.reset(seed=7)[0][1]]
    want += [reference.step(a)[0][1] for a in actions]
    reference.close()
    with envfleet.make(
        fns,
        backend="process",
        num_workers=2,
        on_error="restart",
        step_timeout=STEP_TIMEOUT,
    ) as pool:
        got = [pool.reset(seed=7)[0][1]]
        restarted = np.zeros(2, dtype=bool)
        for a in actions:
            obs, _, _, _, infos = pool.step(a)
            got.append(obs[1])
            if "envfleet/restarted" in infos:
                restarted |= infos["_envfleet/restarted"]
        assert os.path.exists(marker), "env 0 never died: the test tested nothing"
        assert restarted.tolist() == [True, False], f"restarted envs: {restarted.tolist()}"
        stats = pool.stats()
        assert [w.restarts for w in stats.workers] == [1, 0], stats
    for k, (x, y) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_array_equal(x, y, err_msg=f"env 1's observation {k}")
