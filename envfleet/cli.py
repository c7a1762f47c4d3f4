"""The ``envfleet`` command line: ``run``, ``bench`` and ``tune``.

``envfleet run ENV`` steps ``--num-envs`` copies of ``ENV`` with a policy (random by default),
shows live progress on stderr when it is a terminal, and prints a summary: throughput and the
returns of the episodes that finished. Episodes are counted by the CLI from rewards,
terminations and truncations, per env, under Gymnasium's ``NEXT_STEP`` autoreset: the step
after an episode ends is the env's reset step and belongs to no episode.

``--out FILE.npz`` saves the rollout, one row per env-step in the order the steps were
returned (within a batch, in ``env_ids`` order):

* ``env_ids`` (int64): the env that took the step;
* ``actions``: the action sent to it (a Dict/Tuple action space gives ``actions.KEY`` /
  ``actions.INDEX`` arrays instead);
* ``rewards``, ``terminations``, ``truncations``: what the step returned;
* ``autoreset`` (bool): the row is a ``NEXT_STEP`` reset step (its action was ignored, its
  reward is 0): it is part of no episode;
* ``observations`` (only with ``--save-obs``): the observation the action was chosen from.

``--stats`` adds the pool's per-worker statistics (:meth:`envfleet.Pool.stats`: step latency
p50/p99, idle fraction, steps, episodes, restarts) as a table, and under ``"stats"`` in
``--json``.

``envfleet bench ENV`` measures, side by side in one run, a for-loop, the independent-processes
ceiling, envfleet's backends and the peer libraries that are installed, for each ``--num-envs``
of a list (see :mod:`envfleet.benchmark`); it prints a table (steps/s, ratio to the ceiling) and
writes ``bench.json`` and ``bench.png`` (throughput against ``num_envs``) to ``--out DIR``.

``envfleet tune ENV`` probes the env (step time and its variation, reset cost, CPU share,
observation bytes), times a few layouts (backend, workers, threads per worker, batch size)
within ``--budget`` seconds and prints the fastest with the ``envfleet.make(...)`` line to use.

Errors are reported as one ``envfleet: error: ...`` line on stderr, exit status 2 for bad
input (arguments, unknown env id, a policy that cannot be imported) and 1 for failures while
running (for ``bench``: a runner that failed, after the results are written); ``--debug`` adds
the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

import envfleet
from envfleet import benchmark
from envfleet._make import usable_cores
from envfleet.errors import EnvError, PoolStateError
from envfleet.spec import EnvSpec
from envfleet.tune import EnvProfile, Layout, candidate_layouts, profile_env, time_layout

PROG = "envfleet"
DEFAULT_STEPS = 100_000
DEFAULT_BENCH_NUM_ENVS = (8, 32, 64)
DEFAULT_BENCH_OUT = Path("envfleet-bench")
DEFAULT_TUNE_BUDGET = 20.0
TUNE_MIN_WINDOW = 0.1
"""Seconds each layout is timed for at the least, whatever the budget."""
TUNE_SETUP_GUESS = 0.3
"""Seconds to start and close a pool, before one has been measured."""
RECENT_EPISODES = 100
REFRESH_INTERVAL = 0.25
"""Seconds between two refreshes of the live display."""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

Policy = Callable[[Any], Any]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class CliError(Exception):
    """A failure while running: reported on one line, exit status 1."""


class UsageError(CliError):
    """Bad input from the user: reported on one line, exit status 2."""


class PolicyError(CliError):
    """The policy raised or returned actions the pool refused."""


# ---------------------------------------------------------------------------------------------
# Argument parsing


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum`` (``what`` names it in errors)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "a non-negative integer")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _num_envs_list(text: str) -> list[int]:
    """``"8,32,64"``: positive env counts, duplicates dropped, in the order given."""
    values: list[int] = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers such as 8,32,64, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"env counts must be at least 1, got {value}")
        if value not in values:
            values.append(value)
    return values


def _runner_list(text: str) -> list[str]:
    try:
        return benchmark.parse_runners(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``envfleet`` parser: one subparser per command (``run``, ``bench``, ``tune``)."""
    parser = _Parser(
        prog=PROG,
        description="Run many copies of a Gymnasium environment in parallel.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {envfleet.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="step an environment with a policy and report throughput and returns",
        description=(
            "Step NUM_ENVS copies of ENV with a policy (random by default), show live progress "
            "on stderr and print a summary. Episodes are counted per env under Gymnasium's "
            "NEXT_STEP autoreset (the reset step after an episode is part of no episode)."
        ),
        allow_abbrev=False,
    )
    run.add_argument("env", metavar="ENV", help="a registered env id, e.g. CartPole-v1")
    run.add_argument(
        "--num-envs", type=_positive_int, default=8, help="number of envs (default: 8)"
    )
    run.add_argument(
        "--backend",
        choices=[backend.value for backend in envfleet.Backend],
        default=envfleet.Backend.PROCESS.value,
        help="where the envs run (default: process)",
    )
    run.add_argument(
        "--num-workers",
        type=_positive_int,
        help="worker processes (process backend; default: usable cores, at most NUM_ENVS)",
    )
    run.add_argument(
        "--batch-size",
        type=_positive_int,
        help="envs per batch; below NUM_ENVS runs asynchronously (default: NUM_ENVS)",
    )
    run.add_argument(
        "--seed", type=_non_negative_int, default=0, help="env i is seeded seed+i (default: 0)"
    )
    limit = run.add_mutually_exclusive_group()
    limit.add_argument(
        "--steps",
        type=_positive_int,
        help=f"run until at least this many env-steps (default: {DEFAULT_STEPS:_})",
    )
    limit.add_argument("--seconds", type=_positive_float, help="run for this many seconds")
    run.add_argument(
        "--policy",
        metavar="MODULE:FUNCTION",
        help=(
            "a function called with a batch of observations that returns a batch of actions "
            "(default: random actions, seeded); MODULE is imported from the current directory "
            "or the installed packages"
        ),
    )
    run.add_argument(
        "--out", metavar="FILE.npz", type=Path, help="save the rollout to this .npz file"
    )
    run.add_argument(
        "--save-obs", action="store_true", help="also save observations in --out (large)"
    )
    run.add_argument(
        "--json", action="store_true", help="print the summary as JSON on stdout, nothing else"
    )
    run.add_argument(
        "-q", "--quiet", action="store_true", help="no live progress (the summary still prints)"
    )
    run.add_argument(
        "--stats",
        action="store_true",
        help=(
            "show the pool's per-worker statistics at the end: step latency p50/p99, idle "
            "fraction, steps, episodes, restarts (also under 'stats' in --json)"
        ),
    )
    run.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    run.set_defaults(handler=_cmd_run)
    _add_bench_parser(commands)
    _add_tune_parser(commands)
    return parser


def _add_bench_parser(commands: Any) -> None:
    names = ", ".join(benchmark.RUNNERS)
    bench = commands.add_parser(
        "bench",
        help="measure envfleet against a for-loop, the ceiling and peer libraries",
        description=(
            "Measure, side by side in one run, the throughput of a for-loop, independent "
            "processes (the ceiling), envfleet's backends and the peer libraries that are "
            "installed, for each of a list of env counts. Random actions; the windows of the "
            "runners are interleaved and the median is reported. Prints a table and writes "
            "DIR/bench.json and DIR/bench.png (throughput against num_envs). Runners not "
            "installed are left out of the table and listed as such in the JSON."
        ),
        epilog="runners: "
        + "; ".join(f"{kind.name}: {kind.description}" for kind in benchmark.RUNNERS.values()),
        allow_abbrev=False,
    )
    bench.add_argument("env", metavar="ENV", help="a registered env id, e.g. CartPole-v1")
    bench.add_argument(
        "--num-envs",
        type=_num_envs_list,
        default=list(DEFAULT_BENCH_NUM_ENVS),
        metavar="N[,N...]",
        help=(
            "env counts to sweep, comma-separated (default: "
            f"{','.join(map(str, DEFAULT_BENCH_NUM_ENVS))})"
        ),
    )
    bench.add_argument(
        "--runners",
        type=_runner_list,
        metavar="NAME[,NAME...]",
        help=f"comma-separated, from {names} (default: all)",
    )
    bench.add_argument(
        "--seconds",
        type=_positive_float,
        default=1.0,
        help="length of each timed window (default: 1)",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed windows per runner and env count; the median is reported (default: 3)",
    )
    bench.add_argument(
        "--seed", type=_non_negative_int, default=0, help="seeds resets and actions (default: 0)"
    )
    bench.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=DEFAULT_BENCH_OUT,
        help=f"folder for bench.json and bench.png, made if missing (default: {DEFAULT_BENCH_OUT})",
    )
    bench.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout, nothing else"
    )
    bench.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    bench.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    bench.set_defaults(handler=_cmd_bench)


def _add_tune_parser(commands: Any) -> None:
    tune = commands.add_parser(
        "tune",
        help="measure an environment and find the fastest pool layout for it",
        description=(
            "Probe ENV (step time and its variation, reset cost, CPU share, observation size), "
            "time a few layouts (backend, workers, threads per worker, batch size) of NUM_ENVS "
            "envs within the budget, and print the fastest with the envfleet.make(...) line "
            "that uses it. envfleet.make(..., num_workers='auto') applies the same kind of "
            "choice from a shorter probe."
        ),
        allow_abbrev=False,
    )
    tune.add_argument("env", metavar="ENV", help="a registered env id, e.g. CartPole-v1")
    tune.add_argument(
        "--num-envs", type=_positive_int, default=8, help="number of envs (default: 8)"
    )
    tune.add_argument(
        "--budget",
        type=_positive_float,
        default=DEFAULT_TUNE_BUDGET,
        metavar="SECONDS",
        help=(
            "about how long the whole tuning takes, shared among the layouts "
            f"(default: {DEFAULT_TUNE_BUDGET:g})"
        ),
    )
    tune.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout, nothing else"
    )
    tune.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    tune.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    tune.set_defaults(handler=_cmd_tune)


# ---------------------------------------------------------------------------------------------
# Policies


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
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does; the console script would not
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise UsageError(
                f"--policy {spec}: no module named {exc.name!r} (not installed, and not found "
                f"under the current directory {cwd})"
            ) from exc
        raise CliError(f"--policy {spec}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise CliError(
            f"--policy {spec}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
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
# Rollout recording

_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _allocate(space: spaces.Space[Any], n: int, what: str) -> Any:
    """Per-env rows for values of ``space``: an array, or a dict/tuple nest of arrays."""
    if isinstance(space, _ARRAY_SPACES):
        return np.zeros((n, *(space.shape or ())), dtype=space.dtype)
    if isinstance(space, spaces.Dict):
        return {key: _allocate(sub, n, what) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_allocate(sub, n, what) for sub in space.spaces)
    raise UsageError(
        f"--out cannot save {what} of space {space}: only Box, Discrete, MultiDiscrete, "
        "MultiBinary and Dict/Tuple nests of them are supported"
    )


def _put(rows: Any, env_ids: IntArray, values: Any) -> None:
    if isinstance(rows, dict):
        for key, sub in rows.items():
            _put(sub, env_ids, values[key])
    elif isinstance(rows, tuple):
        for sub, value in zip(rows, values, strict=True):
            _put(sub, env_ids, value)
    else:
        rows[env_ids] = values


def _flatten(prefix: str, rows: Any, env_ids: IntArray) -> dict[str, npt.NDArray[Any]]:
    """Copies of rows ``env_ids``, one array per leaf, named ``prefix.key...``."""
    if isinstance(rows, dict):
        return {
            name: array
            for key, sub in rows.items()
            for name, array in _flatten(f"{prefix}.{key}", sub, env_ids).items()
        }
    if isinstance(rows, tuple):
        return {
            name: array
            for index, sub in enumerate(rows)
            for name, array in _flatten(f"{prefix}.{index}", sub, env_ids).items()
        }
    return {prefix: rows[env_ids]}


class Recorder:
    """Collects the rollout row by row and writes it as an ``.npz`` (see the module doc)."""

    def __init__(
        self,
        num_envs: int,
        action_space: spaces.Space[Any],
        observation_space: spaces.Space[Any],
        save_obs: bool,
    ) -> None:
        self._actions = _allocate(action_space, num_envs, "actions")
        self._observations = (
            _allocate(observation_space, num_envs, "observations") if save_obs else None
        )
        self._columns: defaultdict[str, list[npt.NDArray[Any]]] = defaultdict(list)

    def sent(self, env_ids: IntArray, observations: Any, actions: Any) -> None:
        """Remember what each env of ``env_ids`` was sent, until its result comes back."""
        _put(self._actions, env_ids, actions)
        if self._observations is not None:
            _put(self._observations, env_ids, observations)

    def received(
        self,
        env_ids: IntArray,
        rewards: npt.NDArray[Any],
        terminations: BoolArray,
        truncations: BoolArray,
        autoreset: BoolArray,
    ) -> None:
        """Add one row per env of ``env_ids`` (each must have been :meth:`sent` an action)."""
        columns = self._columns
        columns["env_ids"].append(np.array(env_ids, dtype=np.int64))
        for name, array in _flatten("actions", self._actions, env_ids).items():
            columns[name].append(array)
        columns["rewards"].append(np.array(rewards))
        columns["terminations"].append(np.array(terminations, dtype=np.bool_))
        columns["truncations"].append(np.array(truncations, dtype=np.bool_))
        columns["autoreset"].append(np.array(autoreset, dtype=np.bool_))
        if self._observations is not None:
            for name, array in _flatten("observations", self._observations, env_ids).items():
                columns[name].append(array)

    def save(self, path: Path) -> None:
        # An interrupt may land between two appends: keep the batches every column has.
        batches = min((len(chunks) for chunks in self._columns.values()), default=0)
        arrays = {name: np.concatenate(chunks[:batches]) for name, chunks in self._columns.items()}
        with path.open("wb") as file:
            np.savez_compressed(file, **arrays)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Live display


class LiveDisplay:
    """Two lines of live progress on stderr, refreshed by the run loop (no background thread).

    ::

        CartPole-v1 ━━━━━━━━━━━━━━━╺━━━━━━━━  61,440/100,000 steps  0:00:09
        6,826 steps/s · 2,812 episodes · return 22.41 [9.00, 71.00] (last 100)
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
        minutes, seconds = divmod(int(elapsed), 60)
        head = Table.grid(padding=(0, 1))
        head.add_row(Text(self._env, style="bold"), bar, count, Text(f"{minutes}:{seconds:02d}"))
        rate = steps / elapsed if elapsed > 0 else 0.0
        stats = f"{rate:,.0f} steps/s · {tracker.episodes:,} episodes"
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
class RunResult:
    steps: int = 0
    seconds: float = 0.0
    num_workers: int | None = None
    interrupted: bool = False
    tracker: EpisodeTracker = field(default_factory=lambda: EpisodeTracker(0))


class Runner:
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
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.policy_name = policy_name
        self.max_steps = steps if steps is not None else math.inf
        self.max_seconds = seconds if seconds is not None else math.inf
        self.recorder = recorder
        self.display = display
        self.result = RunResult(
            num_workers=_num_workers(pool), tracker=EpisodeTracker(pool.num_envs)
        )
        self._start = time.perf_counter()
        self._next_refresh = math.inf

    def run(self) -> RunResult:
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
        return result.steps > 0 and (result.steps >= self.max_steps or elapsed >= self.max_seconds)


# ---------------------------------------------------------------------------------------------
# The run command


def _out_path(out: Path) -> Path:
    """``out`` with the ``.npz`` suffix numpy would add; its folder must exist."""
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder")
    return out


def _num_workers(pool: envfleet.Pool) -> int | None:
    """Workers the pool runs (``envfleet.make`` picks the default per backend)."""
    workers = getattr(pool, "num_workers", None)
    if isinstance(workers, int):
        return workers
    assignment = getattr(pool, "_assignment", None)  # one tuple of env ids per worker
    return len(assignment) if assignment is not None else None


def _check_run_args(args: argparse.Namespace) -> None:
    if args.batch_size is not None and args.batch_size > args.num_envs:
        raise UsageError(
            f"--batch-size {args.batch_size} exceeds --num-envs {args.num_envs}: "
            "a batch holds at most every env"
        )
    if args.num_workers is not None and args.num_workers > args.num_envs:
        raise UsageError(
            f"--num-workers {args.num_workers} exceeds --num-envs {args.num_envs}: "
            "each worker needs at least one env"
        )
    if args.save_obs and args.out is None:
        raise UsageError("--save-obs needs --out FILE.npz")
    if args.steps is None and args.seconds is None:
        args.steps = DEFAULT_STEPS


def _cmd_run(args: argparse.Namespace) -> int:
    _check_run_args(args)
    out = _out_path(args.out) if args.out is not None else None
    policy = load_policy(args.policy) if args.policy is not None else None
    stderr = Console(stderr=True, highlight=False)
    live = not (args.json or args.quiet) and stderr.is_terminal and not stderr.is_dumb_terminal

    try:
        pool = envfleet.make(
            args.env,
            args.num_envs,
            backend=args.backend,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
            seed=args.seed,
            autoreset_mode=AutoresetMode.NEXT_STEP,
        )
    except (ValueError, TypeError) as exc:  # envfleet.make's checks on its arguments
        raise UsageError(str(exc)) from exc
    with pool:
        if policy is None:
            if pool.batch_size == pool.num_envs:
                space: spaces.Space[Any] = pool.action_space
            else:
                space = batch_space(pool.single_action_space, pool.batch_size)
            space.seed(args.seed)
            policy = RandomPolicy(space)
        recorder = (
            Recorder(
                pool.num_envs,
                pool.single_action_space,
                pool.single_observation_space,
                save_obs=args.save_obs,
            )
            if out is not None
            else None
        )
        display = LiveDisplay(stderr, args.env, args.steps, args.seconds) if live else None
        runner = Runner(
            pool,
            policy,
            args.policy or "random",
            steps=args.steps,
            seconds=args.seconds,
            recorder=recorder,
            display=display,
        )
        if display is not None:
            with display:
                result = runner.run()
        else:
            result = runner.run()
        stats = pool.stats().as_dict() if args.stats else None

    if recorder is not None and out is not None:
        try:
            recorder.save(out)
        except OSError as exc:
            raise CliError(f"writing {out} failed: {exc.strerror or exc}") from exc
    summary = _summary(args, result, out)
    if stats is not None:
        summary["stats"] = stats
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        console = Console(highlight=False)
        console.print(_summary_table(summary))
        if stats is not None:
            console.print(_stats_table(stats))
    if result.interrupted:
        stderr.print(f"{PROG}: interrupted after {result.steps:,} steps")
        return EXIT_INTERRUPTED
    return EXIT_OK


def _summary(args: argparse.Namespace, result: RunResult, out: Path | None) -> dict[str, Any]:
    returns = np.asarray(result.tracker.returns, dtype=np.float64)
    lengths = np.asarray(result.tracker.lengths, dtype=np.float64)
    some = returns.size > 0
    return {
        "env": args.env,
        "backend": args.backend,
        "num_envs": args.num_envs,
        "num_workers": result.num_workers,
        "batch_size": args.batch_size or args.num_envs,
        "seed": args.seed,
        "policy": args.policy or "random",
        "steps": result.steps,
        "seconds": result.seconds,
        "steps_per_second": result.steps / result.seconds if result.seconds > 0 else None,
        "episodes": int(returns.size),
        "return_mean": float(returns.mean()) if some else None,
        "return_min": float(returns.min()) if some else None,
        "return_max": float(returns.max()) if some else None,
        "length_mean": float(lengths.mean()) if some else None,
        "interrupted": result.interrupted,
        "out": str(out) if out is not None else None,
    }


def _summary_table(summary: dict[str, Any]) -> Table:
    def number(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    table = Table(title=f"{PROG} run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("env", summary["env"]),
        ("backend", summary["backend"]),
        ("num_envs", str(summary["num_envs"])),
        ("workers", str(summary["num_workers"] or "-")),
        ("batch_size", str(summary["batch_size"])),
        ("policy", summary["policy"]),
        ("steps", f"{summary['steps']:,}"),
        ("seconds", number(summary["seconds"])),
        ("steps/s", number(summary["steps_per_second"], 0)),
        ("episodes", f"{summary['episodes']:,}"),
        ("mean return", number(summary["return_mean"])),
        ("min return", number(summary["return_min"])),
        ("max return", number(summary["return_max"])),
        ("mean length", number(summary["length_mean"], 1)),
    ]
    if summary["interrupted"]:
        rows.append(("interrupted", "yes"))
    if summary["out"] is not None:
        rows.append(("saved", summary["out"]))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _env_range(env_ids: Sequence[int]) -> str:
    """``0-3`` for a contiguous block of env ids, else the ids."""
    ids = list(env_ids)
    if not ids:
        return "-"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _stats_table(stats: dict[str, Any]) -> Table:
    """:meth:`envfleet.Pool.stats` (as a dict), one row per worker and a total."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(
        title=f"pool stats over {stats['seconds']:.2f} s", title_justify="left", show_footer=True
    )
    workers = stats["workers"]
    idle = [w["idle_fraction"] for w in workers]
    columns = [
        ("worker", "total", "left"),
        ("envs", str(sum(len(w["env_ids"]) for w in workers)), "left"),
        ("steps", f"{stats['steps']:,}", "right"),
        ("episodes", f"{stats['episodes']:,}", "right"),
        ("restarts", f"{stats['restarts']:,}", "right"),
        ("p50 ms", "", "right"),
        ("p99 ms", "", "right"),
        ("idle", f"{sum(idle) / len(idle):.0%}" if idle else "-", "right"),
    ]
    for header, footer, justify in columns:
        table.add_column(header, footer=footer, justify=justify)  # type: ignore[arg-type]
    for w in workers:
        table.add_row(
            str(w["worker"]),
            _env_range(w["env_ids"]),
            f"{w['steps']:,}",
            f"{w['episodes']:,}",
            f"{w['restarts']:,}",
            ms(w["latency_p50_ms"]),
            ms(w["latency_p99_ms"]),
            f"{w['idle_fraction']:.0%}",
        )
    return table


# ---------------------------------------------------------------------------------------------
# Bench and tune


def _env_spec(env: str) -> EnvSpec:
    """The env named on the command line; an unknown id is a usage error."""
    try:
        return EnvSpec.from_user(env)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def _progress(args: argparse.Namespace) -> tuple[Console, bool]:
    """The stderr console, and whether to show live progress on it."""
    stderr = Console(stderr=True, highlight=False)
    live = not (args.json or args.quiet) and stderr.is_terminal and not stderr.is_dumb_terminal
    return stderr, live


def _check_builds(spec: EnvSpec) -> None:
    try:
        env = spec.build()
    except Exception as exc:
        raise CliError(f"building {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    env.close()


def _cmd_bench(args: argparse.Namespace) -> int:
    spec = _env_spec(args.env)
    names: list[str] = args.runners or list(benchmark.RUNNERS)
    explicit = args.runners is not None
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    available = {name: benchmark.availability(name, spec) for name in names}
    if not any(a.ok for a in available.values()):
        reasons = "; ".join(f"{name}: {a.reason}" for name, a in available.items())
        raise CliError(f"none of the runners asked for can run here ({reasons})")
    _check_builds(spec)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot make the folder {out}: {exc.strerror or exc}") from exc

    stderr, live = _progress(args)

    def on_error(name: str, num_envs: int, exc: BaseException) -> None:
        if args.debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        stderr.print(
            f"{PROG}: {name} failed with {num_envs} envs: "
            + _one_line(f"{type(exc).__name__}: {exc}"),
            markup=False,
            soft_wrap=True,
        )

    timing = benchmark.Timing.scaled(args.seconds, args.repeats, seed=args.seed)
    if live:
        with stderr.status(f"{spec.name}: starting") as status:
            report = benchmark.sweep(
                spec,
                args.num_envs,
                names,
                timing,
                on_error=on_error,
                progress=lambda text: status.update(Text(text)),
            )
    else:
        report = benchmark.sweep(spec, args.num_envs, names, timing, on_error=on_error)

    json_path, png_path = out / "bench.json", out / "bench.png"
    try:
        benchmark.write_plot(report, png_path)
        document = benchmark.write_json(
            report, json_path, files={"json": str(json_path), "png": str(png_path)}
        )
    except OSError as exc:
        raise CliError(f"writing the results to {out} failed: {exc.strerror or exc}") from exc
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    else:
        console = Console(highlight=False)
        console.print(benchmark.report_table(report))
        for note in benchmark.report_notes(report):
            console.print(note, markup=False, soft_wrap=True)
        skipped = [n for n in names if not available[n].ok]
        if explicit and skipped:
            console.print(
                "skipped: " + "; ".join(f"{n} ({available[n].reason})" for n in skipped),
                markup=False,
                soft_wrap=True,
            )
        console.print(
            f"results written to {json_path} and {png_path}", markup=False, soft_wrap=True
        )

    if report.interrupted:
        stderr.print(
            f"{PROG}: interrupted; what was measured is in {json_path}",
            markup=False,
            soft_wrap=True,
        )
        return EXIT_INTERRUPTED
    errors = report.errors()
    if errors:
        described = "; ".join(
            f"{name} ({', '.join(f'{n} envs' for n in points)})" for name, points in errors.items()
        )
        raise CliError(
            f"{len(errors)} runner{'s' if len(errors) > 1 else ''} failed: {described}; "
            f"the messages are in {json_path}"
        )
    return EXIT_OK


@dataclass
class LayoutTiming:
    """One layout timed by ``envfleet tune``."""

    layout: Layout
    window_s: float
    steps_per_second: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.layout.backend,
            "num_workers": self.layout.num_workers,
            "threads_per_worker": self.layout.threads_per_worker,
            "batch_size": self.layout.batch_size,
            "make_kwargs": self.layout.make_kwargs(),
            "window_s": self.window_s,
            "steps_per_second": self.steps_per_second,
            "error": self.error,
        }


def tune_layouts(
    spec: EnvSpec,
    num_envs: int,
    budget: float,
    *,
    cores: int | None = None,
    progress: Callable[[str], object] | None = None,
) -> tuple[EnvProfile, list[LayoutTiming]]:
    """Probe the env, then time each candidate layout with what is left of ``budget`` seconds.

    Each layout gets an equal share of the time left when its turn comes, less what starting
    and closing a pool has cost so far (at least :data:`TUNE_MIN_WINDOW` seconds of stepping).
    """
    cores = cores or usable_cores()
    start = time.perf_counter()
    deadline = start + budget
    try:
        profile = profile_env(spec, seconds=min(0.3, budget / 20))
    except Exception as exc:
        raise CliError(f"probing {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    layouts = candidate_layouts(profile, num_envs, cores)
    overheads: list[float] = []
    timings: list[LayoutTiming] = []
    for index, layout in enumerate(layouts):
        setup = sum(overheads) / len(overheads) if overheads else TUNE_SETUP_GUESS
        share = (deadline - time.perf_counter()) / (len(layouts) - index)
        window = max(TUNE_MIN_WINDOW, share - setup)
        if progress is not None:
            progress(f"{spec.name}: layout {index + 1}/{len(layouts)}: {_layout_text(layout)}")
        timing = LayoutTiming(layout, window)
        began = time.perf_counter()
        try:
            timing.steps_per_second = time_layout(spec, num_envs, layout, window)
        except Exception as exc:
            timing.error = f"{type(exc).__name__}: {exc}"
        overheads.append(max(0.0, time.perf_counter() - began - window))
        timings.append(timing)
    return profile, timings


def _layout_text(layout: Layout) -> str:
    parts = [layout.backend, f"{layout.num_workers} worker{'s' * (layout.num_workers != 1)}"]
    if layout.threads_per_worker > 1:
        parts.append(f"{layout.threads_per_worker} threads each")
    if layout.batch_size is not None:
        parts.append(f"batch {layout.batch_size}")
    return ", ".join(parts)


def _profile_table(env: str, num_envs: int, cores: int, profile: EnvProfile) -> Table:
    table = Table(title=f"{env}: one env, probed", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    kind = "waits (sleeps, I/O)" if profile.waits else "computes"
    for name, value in (
        ("step time", f"{profile.step_seconds * 1e6:,.1f} µs"),
        ("step time variation (cv)", f"{profile.step_cv:.2f}"),
        ("reset time", f"{profile.reset_seconds * 1e6:,.1f} µs"),
        ("CPU share of a step", f"{profile.cpu_share:.2f} ({kind})"),
        ("observation", f"{profile.observation_bytes:,} bytes"),
        ("envs / usable cores", f"{num_envs} / {cores}"),
    ):
        table.add_row(name, value)
    return table


def _layouts_table(timings: list[LayoutTiming], best: LayoutTiming) -> Table:
    table = Table(title="layouts, random actions", title_justify="left")
    for header, justify in (
        ("backend", "left"),
        ("workers", "right"),
        ("threads/worker", "right"),
        ("batch", "right"),
        ("window s", "right"),
        ("steps/s", "right"),
        ("/ best", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    top = best.steps_per_second or 0.0
    for timing in timings:
        layout, rate = timing.layout, timing.steps_per_second
        table.add_row(
            layout.backend,
            str(layout.num_workers),
            str(layout.threads_per_worker),
            "all" if layout.batch_size is None else str(layout.batch_size),
            f"{timing.window_s:.2f}",
            "[red]failed[/red]" if rate is None else f"{rate:,.0f}",
            "-" if rate is None or not top else f"{rate / top:.2f}",
            style="bold" if timing is best else None,
        )
    return table


def _cmd_tune(args: argparse.Namespace) -> int:
    spec = _env_spec(args.env)
    cores = usable_cores()
    stderr, live = _progress(args)
    start = time.perf_counter()
    if live:
        with stderr.status(f"{spec.name}: probing") as status:
            profile, timings = tune_layouts(
                spec,
                args.num_envs,
                args.budget,
                cores=cores,
                progress=lambda text: status.update(Text(text)),
            )
    else:
        profile, timings = tune_layouts(spec, args.num_envs, args.budget, cores=cores)
    elapsed = time.perf_counter() - start
    measured = [t for t in timings if t.steps_per_second is not None]
    if not measured:
        raise CliError(
            f"every layout failed; the first: {_layout_text(timings[0].layout)}: {timings[0].error}"
        )
    best = max(measured, key=lambda t: t.steps_per_second or 0.0)
    line = best.layout.describe(args.env, args.num_envs)
    if args.json:
        document = {
            "env": args.env,
            "num_envs": args.num_envs,
            "budget_s": args.budget,
            "seconds": elapsed,
            "usable_cores": cores,
            "profile": profile.as_dict(),
            "layouts": [t.as_dict() for t in timings],
            "best": best.as_dict(),
            "make": line,
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return EXIT_OK
    console = Console(highlight=False)
    console.print(_profile_table(spec.name, args.num_envs, cores, profile))
    console.print(_layouts_table(timings, best))
    console.print(
        f"best: {_layout_text(best.layout)}: {best.steps_per_second:,.0f} steps/s "
        f"(tuned in {elapsed:.1f} s)",
        markup=False,
        soft_wrap=True,
    )
    console.print(line, markup=False, soft_wrap=True)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Entry point


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _report(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {_one_line(message)}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envfleet`` command line; return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        _report(str(exc))
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version print, then exit 0
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    debug = bool(getattr(args, "debug", False))
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt as exc:
        return _fail(exc, "interrupted", EXIT_INTERRUPTED, debug)
    except UsageError as exc:
        return _fail(exc, str(exc), EXIT_USAGE, debug)
    except (CliError, EnvError, PoolStateError) as exc:
        return _fail(exc, str(exc), EXIT_FAILURE, debug)
    except Exception as exc:
        return _fail(exc, f"{type(exc).__name__}: {exc}", EXIT_FAILURE, debug)


def _fail(exc: BaseException, message: str, status: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    _report(message)
    return status


if __name__ == "__main__":
    sys.exit(main())
