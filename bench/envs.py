"""Environments and workloads shared by the benchmarks.

Everything here is defined at module level so that worker processes (fork, forkserver or spawn)
can import it by reference.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces


class NoOpEnv(gymnasium.Env[np.ndarray, int]):
    """An env whose ``step`` does nothing (but sleep ``sleep_s``, if given): a constant
    observation of ``shape`` and ``dtype``, never done (the fixed cost of a step is all that is
    left to measure)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self, shape: tuple[int, ...] = (4,), dtype: Any = np.float32, sleep_s: float = 0.0
    ) -> None:
        low, high = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
        self.observation_space = spaces.Box(low, high, shape=shape, dtype=dtype)
        self.action_space = spaces.Discrete(2)
        self._obs, self.sleep_s = np.ones(shape, dtype=dtype), sleep_s

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self._obs, 0.0, False, False, {}


class SleepEnv(NoOpEnv):
    """An env whose ``step`` sleeps (1 ms by default): the stand-in for a simulator that waits.
    Observations: the step count, the action, the last sleep (ms) and 0 (float32); actions
    ``Discrete(2)``; reward 1 a step; truncated after ``max_steps`` steps."""

    def __init__(self, sleep_s: float = 0.001, max_steps: int = 200) -> None:
        super().__init__(sleep_s=sleep_s)
        self.max_steps, self._t = max_steps, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self._t = 0
        self._obs[:] = 0.0
        return self._obs.copy(), {}

    def sleep(self) -> float:
        return self.sleep_s

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        sleep = self.sleep()
        time.sleep(sleep)
        self._t += 1
        self._obs[:3] = self._t, action, sleep * 1e3
        return self._obs.copy(), 1.0, False, self._t >= self.max_steps, {}


# -- the soak's env (bench/soak.py) ------------------------------------------------------

KINDS = ("raise", "exit", "hang")
"""Failure kinds: raise an exception, ``os._exit`` the worker, sleep far past the timeout."""

# Observation columns.
ENV_INDEX = 0  # the env's index in the pool, from its last action (-1 before the first step)
POOL_STEP = 1  # the pool step id of the action that produced this result (-1 after a reset)
CALLS = 2  # step + reset calls of this env instance (1 after its first reset)
EPISODE_STEP = 3  # steps in this episode (0 after a reset)
EPISODES = 4  # resets of this env instance
OBS_SIZE = 5


class InjectedFailure(RuntimeError):
    """What an injected ``raise`` raises."""


class SoakEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    """Counts every call in its observation; fails with probability ``p_fail`` per step.

    The action is ``[env index, pool step id]`` (float64), echoed in the observation, so that
    the driver can tell which step of which env each result belongs to. Failures (one of
    ``kinds``; a ``hang`` sleeps ``hang_s``) are drawn from an RNG seeded by the env's reset: a
    seeded run injects the same ones every time. Each is logged to ``log_path`` (see
    :func:`read_log`) before it strikes. ``work_us``: busy work per step.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        p_fail: float = 1e-4,
        kinds: tuple[str, ...] = KINDS,
        hang_s: float = 60.0,
        max_steps: int = 1000,
        log_path: str | None = None,
        work_us: float = 0.0,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown failure kinds {sorted(unknown)}: choose from {KINDS}")
        self.observation_space = spaces.Box(-1.0, np.inf, shape=(OBS_SIZE,), dtype=np.float64)
        self.action_space = spaces.Box(0.0, 2.0**52, shape=(2,), dtype=np.float64)
        self.p_fail, self.kinds, self.hang_s = p_fail, tuple(kinds), hang_s
        self.max_steps, self.log_path, self.work_s = max_steps, log_path, work_us * 1e-6
        self._rng = np.random.default_rng()
        self._obs = np.full(OBS_SIZE, -1.0)
        self._obs[CALLS] = self._obs[EPISODE_STEP] = self._obs[EPISODES] = 0.0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        obs = self._obs
        obs[POOL_STEP], obs[EPISODE_STEP] = -1.0, 0.0
        obs[[CALLS, EPISODES]] += 1
        return obs.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs = self._obs
        obs[ENV_INDEX], obs[POOL_STEP] = action[0], action[1]
        if self._rng.random() < self.p_fail:  # drawn even when p_fail is 0: same cost
            self._fail(self.kinds[int(self._rng.integers(len(self.kinds)))])
        if self.work_s > 0:
            deadline = time.perf_counter() + self.work_s
            while time.perf_counter() < deadline:
                pass
        obs[[CALLS, EPISODE_STEP]] += 1
        return obs.copy(), 1.0, False, bool(obs[EPISODE_STEP] >= self.max_steps), {}

    def _fail(self, kind: str) -> None:
        obs = self._obs
        if self.log_path is not None:
            fields = (kind, int(obs[ENV_INDEX]), int(obs[POOL_STEP]), os.getpid(), int(obs[CALLS]))
            with open(self.log_path, "a") as log:  # one short O_APPEND write: atomic
                log.write(" ".join(map(str, fields)) + "\n")
        if kind == "raise":
            raise InjectedFailure(
                f"injected failure: env {int(obs[ENV_INDEX])} at pool step {int(obs[POOL_STEP])}"
            )
        if kind == "exit":
            os._exit(13)  # the exit code of a worker an injected ``exit`` ended
        time.sleep(self.hang_s)


def read_log(path: str) -> list[tuple[str, int, int, int, int]]:
    """The failures a :class:`SoakEnv` logged: ``(kind, env, pool_step, pid, calls)``."""
    if not os.path.exists(path):
        return []
    with open(path) as log:
        return [(k, int(e), int(s), int(p), int(c)) for k, e, s, p, c in map(str.split, log)]


# -- the heavy-tailed env (bench/throughput.py's heavytail, bench/rollout.py) ------------------


class HeavyTailEnv(SleepEnv):
    """A :class:`SleepEnv` whose ``step`` sleeps ``fast_s`` (90%) or ``slow_s`` (10%): a heavy
    tail. Which steps are slow is drawn from the env's own RNG (``self.np_random``), seeded by
    its first reset, so that a seeded run sleeps the same sequence whatever backend steps it."""

    def __init__(
        self,
        fast_s: float = 0.0002,
        slow_s: float = 0.005,
        slow_p: float = 0.1,
        max_steps: int = 500,
    ) -> None:
        super().__init__(fast_s, max_steps)
        self.slow_s, self.slow_p = slow_s, slow_p

    def sleep(self) -> float:
        return self.slow_s if self.np_random.random() < self.slow_p else self.sleep_s


# -- Pong as bench/rollout.py steps it ------------------------------------------------------------

PONG = "ALE/Pong-v5"

ENVPOOL_PONG: dict[str, Any] = dict(
    episodic_life=False,
    reward_clip=False,
    stack_num=4,
    img_height=84,
    img_width=84,
    frame_skip=4,
    noop_max=30,
    repeat_action_probability=0.25,
    max_episode_steps=27_000,
)
"""EnvPool's Pong configured as :func:`make_pong`: 84x84 grey, frame skip 4, 4 frames stacked,
up to 30 no-ops at reset, ALE v5's sticky actions and 108,000 frames an episode, no life-loss
episodes, rewards unclipped."""


def make_pong() -> gymnasium.Env[Any, Any]:
    """Pong with Gymnasium's standard Atari preprocessing: ``AtariPreprocessing`` (84x84 grey,
    frame skip 4, up to 30 no-ops) over the raw ``frameskip=1`` env, then 4 frames stacked:
    observations ``uint8 (4, 84, 84)``."""
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make(PONG, frameskip=1)
    env = gymnasium.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    return gymnasium.wrappers.FrameStackObservation(env, 4)


# -- the workloads of bench/throughput.py ---------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A workload of ``bench/throughput.py``: its name on the command line (``cartpole``), the
    env, how many copies, the runners it measures by default, the row its ratios are to, and
    its target: a row and its least ratio to ``reference``."""

    name: str
    env: str | type[gymnasium.Env[Any, Any]]  # picklable by reference
    num_envs: int
    runners: tuple[str, ...] = ("loop", "ceiling", "bare-pool", "gym-sync", "gym-async")
    reference: str = "ceiling"
    target: tuple[str, float] | None = None


_PROCESS = ("serial", "process", "ale-vector")  # ale-vector: Pong only, left out elsewhere
_HOSTED = (
    "vector",
    "vector-ceiling",
    "vector-recording-ceiling",
    "hosted",
    "hosted-rollout",
    "hosted-rollout-unqueued",
    "process",
)
"""For the hosted workloads: the VectorEnv alone, its ceiling (as is, and acting and recording
as a rollout's worker does), envfleet hosting it (stepped by the driver, and acting on the
workers: rollouts), and envfleet's single-env path."""
_PONG_HOSTED = (
    "ale-vector",
    "ale-hosted",
    "ale-hosted-rollout",
    "vector",
    "hosted",
    "hosted-rollout",
    "process",
)
_ASYNC, _PROCESS_THREADS = "process:batch_size=8", "process:num_workers=2:threads_per_worker=16"
_RAY = ("naive-ray", "batched-ray", "envfleet-ray", "envfleet-ray-calls", "process")
_SLEEP = ("loop", "bare-threads", "thread", "thread:cpu_affinity=[1]", "gym-async")
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cartpole", "CartPole-v1", 64, Target.runners + _PROCESS, target=("process", 0.7)),
        Target("pong", "ALE/Pong-v5", 8, Target.runners + _PROCESS, target=("process", 0.8)),
        Target("sleep", SleepEnv, 32, (*_SLEEP, _PROCESS_THREADS), "loop"),
        # Async: the first 8 envs ready of a heavy tail (HeavyTailEnv), against sync.
        Target("heavytail", HeavyTailEnv, 32, ("process", _ASYNC), "process", (_ASYNC, 1.5)),
        # VectorEnvs hosted by the workers: CartPole's against its ceiling (one per core),
        # Pong's against ale-vector (the id's frames; ale-hosted hosts that very VectorEnv).
        Target(
            "cartpole-1024",
            "CartPole-v1",
            1024,
            _HOSTED,
            "vector-ceiling",
            ("hosted-rollout", 0.85),
        ),
        Target(
            "pong-16", "ALE/Pong-v5", 16, _PONG_HOSTED, "ale-vector", ("ale-hosted-rollout", 0.95)
        ),
        # The ray backend against plain Ray patterns and the process backend, on a local Ray.
        Target("ray-cartpole", "CartPole-v1", 64, _RAY, "naive-ray", ("envfleet-ray", 5.0)),
        Target("ray-pong", "ALE/Pong-v5", 8, _RAY, "process", ("envfleet-ray", 0.8)),
    )
}
