"""Timing pool layouts for ``envfleet tune``, within a budget of seconds.

:func:`tune_layouts` probes the env (:func:`envfleet.tune.profile_env`), takes the candidate
layouts (:func:`envfleet.tune.candidate_layouts`) in order of promise and shares the budget
among them: each gets a window of stepping (:func:`time_layout`) after its pool's start-up,
which is guessed from the probe until one has been measured; layouts the budget cannot time
well are skipped, and a window too short for the env is reported untrusted
(:class:`LayoutTiming`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymnasium.vector.utils import batch_space

from envfleet.affinity import usable_cpus
from envfleet.cli.common import CliError
from envfleet.cli.runner import Policy
from envfleet.spec import EnvSpec
from envfleet.tune import (
    EnvProfile,
    Layout,
    auto_layout,
    candidate_layouts,
    has_vector_entry_point,
    profile_env,
)

__all__ = [
    "MIN_STEPS_PER_ENV",
    "TUNE_GOOD_WINDOW",
    "TUNE_MIN_WINDOW",
    "TUNE_SETUP_GUESS",
    "LayoutTiming",
    "Measurement",
    "cpus_text",
    "layout_text",
    "time_layout",
    "tune_layouts",
]

TUNE_MIN_WINDOW = 0.1
"""Seconds each layout is timed for at the least, whatever the budget."""
TUNE_GOOD_WINDOW = 0.5
"""Seconds of stepping a layout should get: fewer layouts are timed rather than shorter windows."""
TUNE_SETUP_GUESS = 0.3
"""Seconds to start and close a pool, before one has been measured (at least; the probe's
build and reset times scale it)."""
MIN_STEPS_PER_ENV = 5
"""A timing is trusted only when each env was stepped at least this many times in its window."""


@dataclass
class LayoutTiming:
    """One layout timed by ``envfleet tune``."""

    layout: Layout
    window_s: float
    steps_per_second: float | None = None
    error: str | None = None
    steps_per_env: float = 0.0
    untrusted: str | None = None
    """Why the rate cannot be ranked (too few steps per env in the window), or ``None``."""
    skipped: str | None = None
    """Why the layout was not timed (the budget was spent), or ``None``."""

    @property
    def ranked(self) -> bool:
        """Whether the rate was measured well enough to compare with the others."""
        return self.steps_per_second is not None and self.untrusted is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.layout.backend.value,
            "num_workers": self.layout.num_workers,
            "threads_per_worker": self.layout.threads_per_worker,
            "batch_size": self.layout.batch_size,
            "cpu_affinity": self.layout.make_kwargs().get("cpu_affinity"),
            "make_kwargs": self.layout.make_kwargs(),
            "window_s": self.window_s,
            "steps_per_second": self.steps_per_second,
            "steps_per_env": self.steps_per_env,
            "error": self.error,
            "untrusted": self.untrusted,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class Measurement:
    """What :func:`time_layout` measured: the rate and how many steps each env took."""

    steps_per_second: float
    steps_per_env: float
    seconds: float


def time_layout(
    spec: EnvSpec,
    num_envs: int,
    layout: Layout,
    seconds: float,
    *,
    min_steps_per_env: int = MIN_STEPS_PER_ENV,
    deadline: float | None = None,
    policy: Policy | None = None,
) -> Measurement:
    """Time ``layout`` with random actions (or ``policy``'s), after a short warm-up.

    The window lasts ``seconds`` and at least until every env was stepped ``min_steps_per_env``
    times on average (so that a slow env is not judged on one step), but never past
    ``deadline`` (a :func:`time.perf_counter` value). With a ``policy``, it is called with each
    batch of observations and its actions are sent: the rate then includes its cost, and an
    async layout overlaps it with the other half of the envs stepping.
    """
    from envfleet._make import make  # the pool side: envfleet.tune never builds one

    with make(spec, num_envs, seed=0, **layout.make_kwargs()) as pool:
        batch = layout.batch_size or num_envs
        space = batch_space(pool.single_action_space, batch)
        space.seed(0)
        actions = [space.sample() for _ in range(16)]
        steps = calls = 0

        def act(observations: Any) -> Any:
            return actions[calls % 16] if policy is None else policy(observations)

        if layout.batch_size is None:
            observations = pool.reset()[0]
            for _ in range(2):
                observations = pool.step(act(observations))[0]

            def step() -> None:
                nonlocal observations
                observations = pool.step(act(observations))[0]

        else:
            pool.async_reset()
            for _ in range(2 * -(-num_envs // batch)):  # warm-up: every env stepped twice
                result = pool.recv()
                pool.send(act(result[0]), result[4]["env_id"])

            def step() -> None:
                result = pool.recv()
                pool.send(act(result[0]), result[4]["env_id"])

        needed = min_steps_per_env * num_envs
        start = time.perf_counter()
        end = start + seconds
        while True:
            step()
            calls += 1
            steps += batch
            now = time.perf_counter()
            if (now >= end and steps >= needed) or (deadline is not None and now >= deadline):
                break
        elapsed = now - start
        return Measurement(steps / elapsed, steps / num_envs, elapsed)


def tune_layouts(
    spec: EnvSpec,
    num_envs: int,
    budget: float,
    *,
    cores: int | None = None,
    progress: Callable[[str], object] | None = None,
    policy: Policy | None = None,
) -> tuple[EnvProfile, list[LayoutTiming]]:
    """Probe the env, then time candidate layouts within ``budget`` seconds in all.

    With a ``policy``, every layout is timed with it in the loop (see :func:`time_layout`), and
    the candidates include double-buffered async layouts (half the envs step while the policy
    runs on the other half), one of them leaving a core to the policy.

    Layouts are timed in order of promise (the one ``num_workers="auto"`` would pick first).
    Each gets an equal share of the time left, less what starting and closing a pool costs
    (estimated from the probe, then measured); when the shares would fall below
    :data:`TUNE_GOOD_WINDOW` seconds of stepping, the last layouts are not timed (reported as
    skipped) rather than all timed badly, unless stopping would leave more than a tenth of the
    budget unused while a typical start-up leaves room for one more window; the first window
    is short, as the start-up cost is only guessed then. A window lasts until every env has taken
    :data:`MIN_STEPS_PER_ENV` steps; one cut short by the budget is reported as untrusted and
    not ranked.
    """
    cores = cores or len(usable_cpus())
    start = time.perf_counter()
    deadline = start + budget
    try:
        built = time.perf_counter()
        profile = profile_env(spec, seconds=min(0.3, budget / 20))
        probe_s = time.perf_counter() - built
    except Exception as exc:
        raise CliError(f"probing {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    candidates = candidate_layouts(
        profile,
        num_envs,
        cores,
        policy_in_loop=policy is not None,
        hosted=has_vector_entry_point(spec),
    )
    layouts = _by_promise(candidates, profile, num_envs, cores)
    # Starting a pool builds and resets every env (spread over workers) on top of a fixed cost.
    build_s = max(0.0, probe_s - min(0.3, budget / 20)) + profile.reset_seconds
    setup_guess = TUNE_SETUP_GUESS + build_s * num_envs / max(1, min(cores, num_envs))
    min_window = max(TUNE_MIN_WINDOW, 2 * MIN_STEPS_PER_ENV * profile.step_seconds * num_envs)
    overheads: list[float] = []
    timings: list[LayoutTiming] = []
    for index, layout in enumerate(layouts):
        setup = max(overheads) if overheads else setup_guess
        left = deadline - time.perf_counter()
        remaining = len(layouts) - index
        fit = remaining
        while fit > 1 and left / fit - setup < max(min_window, TUNE_GOOD_WINDOW):
            fit -= 1
        window = left / fit - setup
        if timings and window < min_window:
            # Too little left for the slowest start-up seen and a window. Stop, unless that
            # would leave more than a tenth of the budget unused (a start-up slower than
            # planned left the gap) and a typical start-up leaves room for a window.
            typical = sum(overheads) / len(overheads)
            if left < budget / 10 or left - typical < min_window:
                timings.extend(
                    LayoutTiming(rest, 0.0, skipped="budget spent") for rest in layouts[index:]
                )
                break
            window = left - typical
        window = max(min_window, window)
        if not overheads:
            # Until a pool's start-up has been measured, the plan rests on a guess: keep the
            # first window short, so that a wrong guess costs little.
            window = min(window, max(min_window, 2 * TUNE_GOOD_WINDOW))
        if progress is not None:
            progress(f"{spec.name}: layout {index + 1}/{len(layouts)}: {layout_text(layout)}")
        timing = LayoutTiming(layout, window)
        began = time.perf_counter()
        try:
            measured = time_layout(spec, num_envs, layout, window, deadline=deadline, policy=policy)
        except Exception as exc:
            timing.error = f"{type(exc).__name__}: {exc}"
        else:
            timing.steps_per_second = measured.steps_per_second
            timing.steps_per_env = measured.steps_per_env
            timing.window_s = measured.seconds
            if measured.steps_per_env < MIN_STEPS_PER_ENV:
                timing.untrusted = (
                    f"{measured.steps_per_env:.1f} steps per env in the window "
                    f"(under {MIN_STEPS_PER_ENV}): the budget is too short for this env"
                )
        overheads.append(max(0.0, time.perf_counter() - began - timing.window_s))
        timings.append(timing)
    return profile, timings


def _by_promise(
    layouts: list[Layout], profile: EnvProfile, num_envs: int, cores: int
) -> list[Layout]:
    """``layouts`` with the one ``num_workers="auto"`` picks first, then the others in order."""
    first = auto_layout(profile, "process", num_envs, cores)
    return sorted(layouts, key=lambda layout: layout != first)


def layout_text(layout: Layout) -> str:
    parts = [layout.backend.value, f"{layout.num_workers} worker{'s' * (layout.num_workers != 1)}"]
    if layout.threads_per_worker > 1:
        parts.append(f"{layout.threads_per_worker} threads each")
    if layout.batch_size is not None:
        parts.append(f"batch {layout.batch_size}")
    if layout.cpu_affinity is not None:
        parts.append(f"cpus {cpus_text(layout)}")
    if layout.vectorization_mode is not None:
        parts.append("hosted VectorEnv per worker")
    return ", ".join(parts)


def cpus_text(layout: Layout) -> str:
    affinity = layout.cpu_affinity
    if affinity is None:
        return "any"
    return affinity if isinstance(affinity, str) else ",".join(map(str, affinity))
