"""The run loop of ``envfleet run``: a policy steps a pool until a number of steps or seconds.

Episodes are counted here, not by the pool: from rewards, terminations and truncations, per
env, under Gymnasium's ``NEXT_STEP`` autoreset, the step after an episode ends is the env's
reset step and belongs to no episode. The loop also feeds the optional live display (two lines
on stderr) and the optional :class:`~envfleet.cli.recorder.Recorder`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium import spaces
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import envfleet
from envfleet.cli.common import (
    BoolArray,
    CliError,
    IntArray,
    StageLog,
    UsageError,
    clock,
    current_directory_on_path,
    import_user_module,
)
from envfleet.cli.recorder import Recorder

RECENT_EPISODES = 100
REFRESH_INTERVAL = 0.25
"""Seconds between two refreshes of the live display."""

Policy = Callable[[Any], Any]


# ---------------------------------------------------------------------------------------------
# Policies


class PolicyError(CliError):
    """The policy raised or returned actions the pool refused."""


class RandomPolicy:
    """Samples a batch of actions from a (seeded) batched action space, ignoring observations."""

    def __init__(self, space: spaces.Space[Any]) -> None:
        self.space = space

    def __call__(self, observations: Any) -> Any:
        return self.space.sample()


def load_policy(spec: str) -> Policy:
    """Import ``module:function`` (``function`` may be dotted: ``module:Class.method``)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"--policy must look like 'module:function', got {spec!r}")
    current_directory_on_path()
    target: Any = import_user_module(module_name, f"--policy {spec}")
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(
                f"--policy {spec}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise UsageError(
            f"--policy {spec}: {attribute!r} is not callable (it is a {type(target).__name__})"
        )
    policy: Policy = target
    return policy


# ---------------------------------------------------------------------------------------------
# Episode bookkeeping


class EpisodeTracker:
    """Episodic returns and lengths, per env, from what each step returns (NEXT_STEP autoreset).

    The step after an episode's last step is the env's reset step: its reward (0) and flags
    belong to no episode. An episode still running at the end is not counted.
    """

    def __init__(self, num_envs: int, recent: int = RECENT_EPISODES) -> None:
        self._return = np.zeros(num_envs, dtype=np.float64)
        self._length = np.zeros(num_envs, dtype=np.int64)
        self._ended = np.zeros(num_envs, dtype=np.bool_)
        self.returns: list[float] = []
        self.lengths: list[int] = []
        self.recent: deque[float] = deque(maxlen=recent)

    @property
    def episodes(self) -> int:
        return len(self.returns)

    def update(
        self,
        env_ids: IntArray,
        rewards: npt.NDArray[Any],
        terminations: BoolArray,
        truncations: BoolArray,
    ) -> BoolArray:
        """Account for one batch of steps; return which rows were reset steps."""
        autoreset: BoolArray = self._ended[env_ids]
        done = terminations | truncations
        if autoreset.any():
            self._ended[env_ids[autoreset]] = False
            live = ~autoreset
            env_ids, rewards, done = env_ids[live], rewards[live], done[live]
        self._return[env_ids] += rewards
        self._length[env_ids] += 1
        self._ended[env_ids] = done
        if done.any():
            finished = env_ids[done]
            returns = self._return[finished].tolist()
            self.returns += returns
            self.lengths += self._length[finished].tolist()
            self.recent.extend(returns)
            self._return[finished] = 0.0
            self._length[finished] = 0
        return autoreset


# ---------------------------------------------------------------------------------------------
# Live display


def remaining(
    steps: int, elapsed: float, max_steps: int | None, max_seconds: float | None
) -> float | None:
    """Seconds left to the run's limit at the rate so far (``None`` before there is a rate)."""
    if max_steps is not None:
        if steps <= 0 or elapsed <= 0:
            return None
        return max(0.0, (max_steps - steps) * elapsed / steps)
    assert max_seconds is not None
    return max(0.0, max_seconds - elapsed)


def progress_text(
    steps: int, elapsed: float, max_steps: int | None, max_seconds: float | None
) -> str:
    """``61,440/100,000 steps · 6,826 steps/s · ETA 0:06`` (the plain progress line)."""
    count = f"{steps:,}/{max_steps:,} steps" if max_steps is not None else f"{steps:,} steps"
    rate = steps / elapsed if elapsed > 0 else 0.0
    left = remaining(steps, elapsed, max_steps, max_seconds)
    return f"{count} · {rate:,.0f} steps/s · ETA {'-' if left is None else clock(left)}"


class LiveDisplay:
    """Two lines of live progress on stderr, refreshed by the run loop (no background thread).

    ::

        CartPole-v1 ━━━━━━━━━━━━━━━╺━━━━━━━━  61,440/100,000 steps  ETA 0:06
        6,826 steps/s · 0:09 elapsed · 2,812 episodes · return 22.41 [9.00, 71.00] (last 100)
    """

    def __init__(
        self, console: Console, env: str, steps: int | None, seconds: float | None
    ) -> None:
        self._env, self._steps, self._seconds = env, steps, seconds
        self._live = Live(console=console, auto_refresh=False, transient=True)

    def __enter__(self) -> LiveDisplay:
        self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.stop()

    def update(self, steps: int, elapsed: float, tracker: EpisodeTracker) -> None:
        if self._steps is not None:
            bar = ProgressBar(total=self._steps, completed=min(steps, self._steps), width=24)
            count = f"{steps:,}/{self._steps:,} steps"
        else:
            assert self._seconds is not None
            bar = ProgressBar(total=self._seconds, completed=min(elapsed, self._seconds), width=24)
            count = f"{steps:,} steps"
        left = remaining(steps, elapsed, self._steps, self._seconds)
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text(self._env, style="bold"),
            bar,
            count,
            Text(f"ETA {'-' if left is None else clock(left)}"),
        )
        rate = steps / elapsed if elapsed > 0 else 0.0
        stats = f"{rate:,.0f} steps/s · {clock(elapsed)} elapsed · {tracker.episodes:,} episodes"
        if tracker.recent:
            recent = np.fromiter(tracker.recent, dtype=np.float64, count=len(tracker.recent))
            stats += (
                f" · return {recent.mean():.2f} [{recent.min():.2f}, {recent.max():.2f}]"
                f" (last {len(recent)})"
            )
        self._live.update(Group(head, Text(stats)), refresh=True)


# ---------------------------------------------------------------------------------------------
# The run loop


@dataclass
class RunSummary:
    steps: int = 0
    seconds: float = 0.0
    num_workers: int | None = None
    interrupted: bool = False
    tracker: EpisodeTracker = field(default_factory=lambda: EpisodeTracker(0))


class RunLoop:
    """Steps a pool with a policy until a number of env-steps or seconds is reached."""

    def __init__(
        self,
        pool: envfleet.Pool,
        policy: Policy,
        policy_name: str,
        *,
        steps: int | None,
        seconds: float | None,
        recorder: Recorder | None,
        display: LiveDisplay | None,
        stages: StageLog | None = None,
    ) -> None:
        self.pool = pool
        self.stages = stages
        self.policy = policy
        self.policy_name = policy_name
        self.steps_limit, self.seconds_limit = steps, seconds
        self.max_steps = steps if steps is not None else math.inf
        self.max_seconds = seconds if seconds is not None else math.inf
        self.recorder = recorder
        self.display = display
        self.result = RunSummary(
            num_workers=pool.num_workers, tracker=EpisodeTracker(pool.num_envs)
        )
        self._start = time.perf_counter()
        self._next_refresh = math.inf

    def run(self) -> RunSummary:
        """Run until the limit (or Ctrl-C, which stops early and keeps what ran)."""
        asynchronous = self.pool.batch_size < self.pool.num_envs
        try:
            if asynchronous:
                self._run_async()
            else:
                self._run_sync()
        except KeyboardInterrupt:
            self.result.interrupted = True
        self.result.seconds = time.perf_counter() - self._start
        return self.result

    def _begin(self) -> None:
        self._start = time.perf_counter()
        if self.display is not None:
            self._next_refresh = self._start

    def _run_sync(self) -> None:
        pool = self.pool
        env_ids: IntArray = np.arange(pool.num_envs, dtype=np.int64)
        observations, _ = pool.reset()
        self._begin()
        while True:
            actions = self._act(observations)
            try:
                next_observations, rewards, terminations, truncations, _ = pool.step(actions)
            except envfleet.EnvError:  # an env's failure (of its own exception type too)
                raise
            except (ValueError, TypeError) as exc:  # the pool checks actions before stepping
                raise self._bad_actions(exc) from exc
            if self.recorder is not None:
                self.recorder.sent(env_ids, observations, actions)
            observations = next_observations
            if self._account(env_ids, rewards, terminations, truncations):
                return

    def _run_async(self) -> None:
        pool = self.pool
        started = np.zeros(pool.num_envs, dtype=np.bool_)
        all_started = False
        pool.async_reset()
        self._begin()
        while True:
            observations, rewards, terminations, truncations, infos = pool.recv()
            env_ids: IntArray = np.asarray(infos["env_id"], dtype=np.int64)
            if all_started:
                stop = self._account(env_ids, rewards, terminations, truncations)
            else:  # an env's first result is its reset, not a step
                stepped = started[env_ids]
                started[env_ids] = True
                all_started = bool(started.all())
                stop = self._account(
                    env_ids[stepped], rewards[stepped], terminations[stepped], truncations[stepped]
                )
            if stop:
                return
            actions = self._act(observations)
            try:
                pool.send(actions, env_ids)
            except envfleet.EnvError:  # an env's failure (of its own exception type too)
                raise
            except (ValueError, TypeError) as exc:
                raise self._bad_actions(exc) from exc
            if self.recorder is not None:
                self.recorder.sent(env_ids, observations, actions)

    def _act(self, observations: Any) -> Any:
        try:
            return self.policy(observations)
        except Exception as exc:
            raise PolicyError(
                f"policy {self.policy_name} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _bad_actions(self, exc: Exception) -> PolicyError:
        return PolicyError(f"policy {self.policy_name} returned invalid actions: {exc}")

    def _account(
        self,
        env_ids: IntArray,
        rewards: npt.NDArray[Any],
        terminations: BoolArray,
        truncations: BoolArray,
    ) -> bool:
        """Count one batch of steps; return whether the run is over."""
        result = self.result
        if env_ids.size:
            autoreset = result.tracker.update(env_ids, rewards, terminations, truncations)
            if self.recorder is not None:
                self.recorder.received(env_ids, rewards, terminations, truncations, autoreset)
            result.steps += int(env_ids.size)
        now = time.perf_counter()
        elapsed = now - self._start
        if now >= self._next_refresh:
            assert self.display is not None
            self.display.update(result.steps, elapsed, result.tracker)
            self._next_refresh = now + REFRESH_INTERVAL
        if self.stages is not None:  # piped: a plain line every few seconds
            steps = result.steps
            self.stages.progress(
                lambda: progress_text(steps, elapsed, self.steps_limit, self.seconds_limit)
            )
        return result.steps > 0 and (result.steps >= self.max_steps or elapsed >= self.max_seconds)


__all__ = [
    "RECENT_EPISODES",
    "REFRESH_INTERVAL",
    "EpisodeTracker",
    "LiveDisplay",
    "Policy",
    "PolicyError",
    "RandomPolicy",
    "RunLoop",
    "RunSummary",
    "load_policy",
    "progress_text",
    "remaining",
]
