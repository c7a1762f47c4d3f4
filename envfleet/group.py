"""EnvGroup: the one stepping loop, shared by every backend.

A group owns a few envs of the pool (global indices) and the batch arrays it writes into:
shared-memory views in a worker process, the pool's own arrays in the serial and thread
backends. It applies the autoreset mode and catches each env's exceptions as
:class:`~envfleet.protocol.EnvFailure` records, so one env's crash never stops the others.

Under ``on_error="restart"`` a failed env is rebuilt here, at once, and its interrupted episode
is reported as truncated (reward 0, ``infos["envfleet/restarted"]``); the fresh env is reset
with a seed derived from the pool seed, the env index and its restart count.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.buffers import Batch, make_reader, make_writer
from envfleet.errors import OnError, Phase
from envfleet.protocol import EnvFailure, Reply
from envfleet.spec import EnvSpec
from envfleet.validation import same_space

T = TypeVar("T")

RESTARTED = "envfleet/restarted"
"""Info key set on the result that reports an env's restart."""

BATCHED_MIN_ENVS = 12
"""Groups stepping at least this many envs write their results with one assignment per field;
smaller ones env by env, which costs less below it (numpy's fixed cost per assignment)."""

SMALL_ROW_BYTES = 1024
"""Observation rows up to this size are gathered into one array and written at once; larger
ones (frames) are copied into their rows one by one, with no temporary array."""


def derive_seed(seed_base: int | None, env_index: int, restarts: int) -> int | None:
    """The seed a restarted env is reset with: deterministic when the pool is seeded."""
    if seed_base is None:
        return None
    return int(np.random.SeedSequence([seed_base, env_index, restarts]).generate_state(1)[0])


_worker_process = False  # set by claim_base_exceptions(): this whole process is a worker
_alarm_dumps_stacks = False  # faulthandler registered on SIGALRM in this process


def claim_base_exceptions() -> None:
    """Declare this process a worker of its own (a worker process, a Ray actor): then any
    ``BaseException`` an env raises, on its main thread too, is that env's failure. Such a
    process ignores SIGINT, so a ``KeyboardInterrupt`` there comes from the env, never from the
    user's Ctrl-C (which the pool's process handles)."""
    global _worker_process
    _worker_process = True
    _take_alarm()


def _stderr_fd() -> int:
    """Where faulthandler writes the stacks: this process's stderr, or descriptor 2 where
    ``sys.stderr`` has no descriptor of its own (pytest's capsys, a notebook's stream)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2


def _take_alarm() -> None:
    """Give SIGALRM, which bounds env rebuilds here (:func:`exit_if_longer`), its default
    action, ending the process once faulthandler has dumped the stacks. A handler inherited
    through fork (pytest-timeout's, a user's) would instead raise inside the env's build."""
    global _alarm_dumps_stacks
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    except ValueError:  # not this process's main thread: exit_if_longer registers on use
        return
    faulthandler.register(signal.SIGALRM, file=_stderr_fd(), all_threads=True, chain=True)
    _alarm_dumps_stacks = True


def env_errors() -> tuple[type[BaseException], ...]:
    """What counts as an env's own failure: any exception, ``SystemExit`` included (an env that
    calls ``sys.exit()`` fails like one that raises); in a worker process (see
    :func:`claim_base_exceptions`) or on any thread but the main one, any ``BaseException`` at
    all (``KeyboardInterrupt``, ``GeneratorExit``, a library's own), which would otherwise end
    a worker that holds other envs. On the caller's main thread (serial backend, the probe) a
    ``KeyboardInterrupt`` is the user's Ctrl-C and is not caught."""
    if not _worker_process and threading.current_thread() is threading.main_thread():
        return (Exception, SystemExit)
    return (BaseException,)


_timers_lock = threading.Lock()
_timers = 0  # blocks inside exit_if_longer now (threads_per_worker: one per thread)


@contextlib.contextmanager
def exit_if_longer(seconds: float | None) -> Iterator[None]:
    """End this process (killed by SIGALRM, the stuck threads' stacks on stderr) if the block
    takes longer than ``seconds`` (``None``: no bound). Only for a worker process of its own:
    the pool then sees a dead worker, which its own bounds handle (restart, ``start_timeout``).

    The bound is the process's real-time interval timer: the kernel delivers SIGALRM, whose
    handler (faulthandler's, in C) dumps every thread's stack and then lets the signal's
    default action end the process, so it fires even while the block holds the GIL. It is one
    per process: blocks on several threads at once share it, re-armed by each.
    ``faulthandler.dump_traceback_later`` is not used: in a worker forked from a process whose
    own faulthandler timer runs (pytest's ``faulthandler_timeout``, a user's watchdog), arming
    it waits for ever for the parent's watchdog thread, which the fork did not copy.
    """
    global _timers, _alarm_dumps_stacks
    if seconds is None:
        yield
        return
    with _timers_lock:
        _timers += 1
        if not _alarm_dumps_stacks:
            faulthandler.register(signal.SIGALRM, file=_stderr_fd(), all_threads=True, chain=True)
            _alarm_dumps_stacks = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        with _timers_lock:
            _timers -= 1
            if not _timers:
                signal.setitimer(signal.ITIMER_REAL, 0)


class Abandoned(TimeoutError):
    """:func:`build_within` gave up waiting (what the build itself raises is never this)."""


def build_within(
    seconds: float,
    build: Callable[[], T],
    discard: Callable[[T], None] | None = None,
    name: str = "envfleet-rebuild",
) -> T:
    """``build()`` on a helper thread, waited for at most ``seconds``: past it
    :class:`Abandoned` (a :class:`TimeoutError`), the stuck thread (a daemon, which cannot be
    stopped) abandoned; should it finish after all, ``discard`` gets what it built. What
    ``build`` raises is raised here."""
    done: list[tuple[bool, Any]] = []
    lock = threading.Lock()
    abandoned = False

    def run() -> None:
        try:
            result: tuple[bool, Any] = (True, build())
        except BaseException as exc:  # raised again in the waiting thread
            result = (False, exc)
        with lock:
            if not abandoned:
                done.append(result)
                return
        if result[0] and discard is not None:
            discard(result[1])

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    helper.join(seconds)
    with lock:
        abandoned = not done
    if abandoned:
        raise Abandoned(
            f"rebuilding the env took longer than start_timeout={seconds:g}s; the thread "
            "building it cannot be stopped and was abandoned"
        )
    ok, value = done[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


class GroupStartError(Exception):
    """Building an env of the group failed; carries the failure record."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class EnvGroup:
    """Several envs stepped one after another, writing rows of shared batch arrays.

    Args:
        spec: how to build each env.
        env_ids: global indices of the envs this group owns.
        batch: arrays of the whole pool; the group writes only its own rows.
        autoreset_mode: Gymnasium's autoreset semantics to apply.
        observation_space: the pool's single observation space (each env must match it).
        action_space: the pool's single action space (each env must match it).
        on_error: rebuild a failed env in place (``RESTART``) or report it (``RAISE``).
        seed_base: the pool's seed, from which restarted envs' seeds derive.
        restarts: restarts so far per env (a restarted worker continues the count).
        restarted: this group replaces a worker that died: every env starts restarted.
        rebuild_timeout: in a worker process of its own (never the caller's): seconds the
            rebuild of a failed env may take (``start_timeout``) before the process ends itself
            (:func:`exit_if_longer`), so that the pool sees a dead worker instead of waiting
            for ever; ``None``: not bounded here.
        rebuild_thread_timeout: in a worker thread of the caller's process (the thread
            backend): seconds the rebuild of a failed env may take (``start_timeout``); it
            runs on a helper thread, abandoned past it, and the env fails (phase ``make``).
    """

    def __init__(
        self,
        spec: EnvSpec,
        env_ids: Sequence[int],
        batch: Batch,
        autoreset_mode: AutoresetMode,
        observation_space: gymnasium.Space[Any],
        action_space: gymnasium.Space[Any],
        on_error: OnError = OnError.RAISE,
        seed_base: int | None = None,
        restarts: Mapping[int, int] | None = None,
        restarted: bool = False,
        rebuild_timeout: float | None = None,
        rebuild_thread_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        self.rebuild_timeout = rebuild_timeout
        self.rebuild_thread_timeout = rebuild_thread_timeout
        self.env_ids = tuple(env_ids)
        self.batch = batch
        self.mode = autoreset_mode
        self.on_error = on_error
        self.seed_base = seed_base
        self.observation_space = observation_space
        self.action_space = action_space
        self.restarts = {i: (restarts or {}).get(i, 0) for i in self.env_ids}
        self.envs: dict[int, gymnasium.Env[Any, Any]] = {}
        self._owe_reset: set[int] = set()  # envs whose episode ended (NEXT_STEP: reset next)
        self._truncate_next: set[int] = set()  # restarted envs owing a truncated result
        self._reset_seed: dict[int, int | None] = {}  # seeds for restarted envs' next reset
        self._restart_log: list[EnvFailure] = []
        self._write_obs = make_writer(observation_space, batch.observations)
        self._read_obs = make_reader(observation_space, batch.observations)
        self._read_action = make_reader(action_space, batch.actions)
        # The batched step (one assignment per field): actions in one array, and autoreset
        # modes that keep one result per env; SAME_STEP steps env by env.
        self._batched = (
            isinstance(batch.actions, np.ndarray) and autoreset_mode is not AutoresetMode.SAME_STEP
        )
        # Observations in one array whose rows are small: written with one assignment (a large
        # row, a frame, is copied straight into the batch instead, through no temporary).
        obs = batch.observations
        self._obs_shape: tuple[int, ...] | None = (
            tuple(obs.shape[1:])
            if isinstance(obs, np.ndarray) and obs[:1].nbytes <= SMALL_ROW_BYTES
            else None
        )
        self._rows_key: Sequence[int] | None = None
        self._rows_value: tuple[slice | np.ndarray, list[Any]] = (slice(0), [])
        for i in self.env_ids:
            try:
                self.envs[i] = self._build(i)
            except env_errors() as exc:
                self.close()
                raise GroupStartError(EnvFailure.capture(i, Phase.MAKE, exc)) from exc
            if restarted:
                self._owe_truncation(i)

    def reset(
        self,
        env_ids: Sequence[int],
        seeds: Sequence[int | None],
        options: dict[str, Any] | None,
    ) -> Reply:
        """Reset ``env_ids``, writing their first observations."""
        batch = self.batch
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        for i, seed in zip(env_ids, seeds, strict=True):
            if seed is None:
                seed = self._reset_seed.pop(i, None)
            restarted = i in self._truncate_next
            self._truncate_next.discard(i)
            try:
                obs, info = self.envs[i].reset(seed=seed, options=options)
                self._write_obs(i, obs)
            except env_errors() as exc:
                failure = EnvFailure.capture(i, Phase.RESET, exc)
                if self.on_error is OnError.RAISE or not self._restart(i, failure, failures):
                    failures.append(failure)
                    continue
                try:
                    obs, info = self.envs[i].reset(seed=self._reset_seed.pop(i), options=options)
                    self._write_obs(i, obs)
                except env_errors() as exc2:
                    failures.append(EnvFailure.capture(i, Phase.RESET, exc2))
                    continue
                self._truncate_next.discard(i)
                restarted = True
            batch.terminations[i] = batch.truncations[i] = False
            self._owe_reset.discard(i)
            if restarted:
                info = {**info, RESTARTED: True}
            if info:
                infos[i] = info
        return self._reply(env_ids, infos, failures)

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply:
        """Step ``env_ids`` with the actions in their batch rows, applying autoreset."""
        infos: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        kept: list[int] = []
        if (
            actions is None
            and self._batched
            and not self._truncate_next
            and len(env_ids) >= BATCHED_MIN_ENVS
        ):
            self._step_batched(env_ids, infos, failures, kept)
        else:
            self._step_each(env_ids, actions, infos, failures, kept)
        return self._reply(env_ids, infos, failures, kept)

    def _step_batched(
        self,
        env_ids: Sequence[int],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """The hot path: every env's result is collected first, then written with one
        assignment per field, as ``SyncVectorEnv`` does; nothing is done per env beyond its
        ``step`` (issue 23). The first env that raises hands the rest to :meth:`_step_each`."""
        index, envs = self._rows(env_ids)
        actions = self.batch.actions[index]
        if actions.ndim > 1:
            # Rows of a copy, not views of the batch: an env that keeps its action must not see
            # the next step's actions written over it.
            actions = actions.copy()
        owe = self._owe_reset if self.mode is AutoresetMode.NEXT_STEP else None
        results: list[Any] = []
        append = results.append
        reset_ids: list[int] = []
        try:
            # zip without strict: the three have one entry per env by construction, and the
            # check costs more than the rest of a small group's step.
            for i, env, action in zip(env_ids, envs, actions):  # noqa: B905
                if owe and i in owe:
                    reset_ids.append(i)
                    obs, info = env.reset(seed=self._reset_seed.pop(i, None))
                    append((obs, 0.0, False, False, info))
                else:
                    append(env.step(action))
        except env_errors() as exc:
            k = len(results)
            if reset_ids and reset_ids[-1] == env_ids[k]:
                reset_ids.pop()
            done = env_ids[:k]
            self._write_rows(done, _index(done), results, reset_ids, infos, failures, kept)
            self._failed(env_ids[k], exc, infos, failures, kept)
            self._step_each(env_ids[k + 1 :], None, infos, failures, kept)
            return
        self._write_rows(env_ids, index, results, reset_ids, infos, failures, kept)

    def _write_rows(
        self,
        env_ids: Sequence[int],
        index: slice | np.ndarray,
        results: list[Any],
        reset_ids: list[int],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Write the ``(obs, reward, terminated, truncated, info)`` of ``env_ids`` into their
        rows at once; any result that does not fit is handled env by env
        (:meth:`_write_each`), so that its failure names the env."""
        if not env_ids:
            return
        batch = self.batch
        try:
            # strict: one result of another length than 5 among the others fails here too.
            observations, rewards, terminations, truncations, env_infos = zip(*results, strict=True)
            if self._obs_shape is not None:  # small rows: one array, its shape checked
                values = np.asarray(observations)
                if values.dtype == object or values.shape != (len(env_ids), *self._obs_shape):
                    raise ValueError("an observation does not fit its row")
                batch.observations[index] = values
            else:
                write_obs = self._write_obs
                for i, obs in zip(env_ids, observations, strict=True):
                    write_obs(i, obs)
            batch.rewards[index] = rewards
            batch.terminations[index] = terminations
            batch.truncations[index] = truncations
        except Exception:
            self._write_each(env_ids, results, infos, failures, kept)
            return
        owe = self._owe_reset
        if reset_ids:
            owe.difference_update(reset_ids)
        if any(terminations) or any(truncations):
            owe.update(
                i for i, te, tr in zip(env_ids, terminations, truncations, strict=True) if te or tr
            )
        if any(env_infos):
            for i, info in zip(env_ids, env_infos, strict=True):
                if info:
                    infos[i] = info

    def _write_each(
        self,
        env_ids: Sequence[int],
        results: list[Any],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Results written one env at a time, as :meth:`_step_each` does (the slow path)."""
        batch, owe = self.batch, self._owe_reset
        for i, result in zip(env_ids, results, strict=True):
            try:
                obs, reward, terminated, truncated, info = result
                self._write_obs(i, obs)
            except env_errors() as exc:
                self._failed(i, exc, infos, failures, kept)
                continue
            batch.rewards[i] = reward
            batch.terminations[i] = terminated
            batch.truncations[i] = truncated
            if terminated or truncated:
                owe.add(i)
            else:
                owe.discard(i)
            if info:
                infos[i] = info

    def _step_each(
        self,
        env_ids: Sequence[int],
        actions: dict[int, Any] | None,
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Step ``env_ids`` one env at a time (carried actions, restarts, ``SAME_STEP``)."""
        batch = self.batch
        rewards, terms, truncs = batch.rewards, batch.terminations, batch.truncations
        # Carried actions (another dtype than the batch arrays', or no shared arrays) reach the
        # env as the caller gave them, never cast into the batch first.
        read_action = self._read_action if actions is None else actions.__getitem__
        envs, owe, write_obs = self.envs, self._owe_reset, self._write_obs
        next_step = self.mode is AutoresetMode.NEXT_STEP
        same_step = self.mode is AutoresetMode.SAME_STEP
        truncate_next = self._truncate_next
        for i in env_ids:
            if truncate_next and i in truncate_next:
                self._truncate(i, infos, failures, kept)
                continue
            env = envs[i]
            reward: Any
            try:
                if next_step and i in owe:
                    obs, info = env.reset(seed=self._reset_seed.pop(i, None))
                    reward, terminated, truncated = 0.0, False, False
                else:
                    obs, reward, terminated, truncated, info = env.step(read_action(i))
                    if same_step and (terminated or truncated):
                        final = {"final_obs": obs, "final_info": info}
                        obs, info = env.reset(seed=self._reset_seed.pop(i, None))
                        info = {**final, **info}
                write_obs(i, obs)
            except env_errors() as exc:
                self._failed(i, exc, infos, failures, kept)
                continue
            rewards[i] = reward
            terms[i] = terminated
            truncs[i] = truncated
            if terminated or truncated:
                owe.add(i)
            else:
                owe.discard(i)
            if info:
                infos[i] = info

    def _failed(
        self,
        i: int,
        exc: BaseException,
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: list[int],
    ) -> None:
        """Env ``i`` raised ``exc`` stepping: report it, or restart it and truncate its episode."""
        failure = EnvFailure.capture(i, Phase.STEP, exc)
        if self.on_error is OnError.RAISE or not self._restart(i, failure, failures):
            failures.append(failure)
        else:
            self._truncate(i, infos, failures, kept)

    def _rows(self, env_ids: Sequence[int]) -> tuple[slice | np.ndarray, list[Any]]:
        """The batch rows of ``env_ids`` and their envs, kept for the command repeated every
        step (a tuple, the same object each time)."""
        if env_ids is self._rows_key:
            return self._rows_value
        value = (_index(env_ids), [self.envs[i] for i in env_ids])
        if isinstance(env_ids, tuple):
            self._rows_key, self._rows_value = env_ids, value
        return value

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        """Call ``name`` on each env (or read it, when it is not callable)."""
        values: dict[int, Any] = {}
        failures: list[EnvFailure] = []
        for i, env in self.envs.items():
            try:
                attr = env.get_wrapper_attr(name)
                values[i] = attr(*args, **kwargs) if callable(attr) else attr
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(values=values, failures=tuple(failures))

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply:
        """Set attribute ``name`` of each env to its value."""
        failures: list[EnvFailure] = []
        for i, value in values.items():
            try:
                self.envs[i].set_wrapper_attr(name, value)
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CALL, exc))
        return Reply(failures=tuple(failures))

    def close(self) -> Reply:
        """Close every env, reporting (not raising) what fails."""
        failures: list[EnvFailure] = []
        for i, env in self.envs.items():
            try:
                env.close()
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.CLOSE, exc))
        self.envs.clear()
        self._rows_key = None
        return Reply(failures=tuple(failures))

    # -- restarts ----------------------------------------------------------------------------

    def _build(self, i: int) -> gymnasium.Env[Any, Any]:
        """Build env ``i`` with its own recipe (``env_fns[i]``) and check its spaces."""
        spec = self.spec.for_env(i)
        env = spec.build()
        for what, got, expected in (
            ("observation", env.observation_space, self.observation_space),
            ("action", env.action_space, self.action_space),
        ):
            if not same_space(got, expected):
                env.close()
                raise ValueError(
                    f"env {i} ({spec.name}) has {what} space {got}, but env 0's is {expected}: "
                    "every env of a pool must have the same spaces (Gymnasium's vector envs "
                    "raise RuntimeError here too)"
                )
        return env

    def _restart(self, i: int, failure: EnvFailure, failures: list[EnvFailure]) -> bool:
        """Replace env ``i`` by a fresh one; False (and a failure recorded) if that fails."""
        self.restarts[i] += 1
        self._restart_log.append(failure)
        self._rows_key = None  # the env list it keeps holds the env replaced here
        try:
            self.envs[i].close()
        except env_errors():
            pass  # the env is broken; its close may be too
        try:
            if self.rebuild_thread_timeout is not None:
                self.envs[i] = build_within(
                    self.rebuild_thread_timeout, lambda: self._build(i), _close_quietly
                )
            else:
                with exit_if_longer(self.rebuild_timeout):
                    self.envs[i] = self._build(i)
        except env_errors() as exc:
            failures.append(EnvFailure.capture(i, Phase.MAKE, exc))
            return False
        self._owe_truncation(i)
        return True

    def _owe_truncation(self, i: int) -> None:
        self._truncate_next.add(i)
        self._reset_seed[i] = derive_seed(self.seed_base, i, self.restarts[i])

    def _truncate(
        self, i: int, infos: dict[int, Any], failures: list[EnvFailure], kept: list[int]
    ) -> None:
        """Report the interrupted episode of restarted env ``i`` as truncated."""
        self._truncate_next.discard(i)
        info: dict[str, Any] = {RESTARTED: True}
        if self.mode is AutoresetMode.SAME_STEP:
            final_obs = copy.deepcopy(self._read_obs(i))
            try:
                obs, reset_info = self.envs[i].reset(seed=self._reset_seed.pop(i, None))
                self._write_obs(i, obs)
            except env_errors() as exc:
                failures.append(EnvFailure.capture(i, Phase.RESET, exc))
                return
            info = {"final_obs": final_obs, "final_info": {}, **reset_info, **info}
            self._owe_reset.discard(i)
        else:
            # The latest observation stands (the last delivered, or, when a worker died after this
            # env had stepped, what that step produced); the next step or reset starts anew.
            kept.append(i)
            self._owe_reset.add(i)
        self.batch.rewards[i] = 0.0
        self.batch.terminations[i] = False
        self.batch.truncations[i] = True
        infos[i] = info

    def _reply(
        self,
        env_ids: Sequence[int],
        infos: dict[int, Any],
        failures: list[EnvFailure],
        kept: Sequence[int] = (),
    ) -> Reply:
        restarts, self._restart_log = tuple(self._restart_log), []
        return Reply(
            env_ids=tuple(env_ids),
            infos=infos or None,
            failures=tuple(failures),
            restarts=restarts,
            kept=tuple(kept),
        )


def _index(env_ids: Sequence[int]) -> slice | np.ndarray:
    """Rows ``env_ids`` of a batch array: a slice when they are consecutive, in order."""
    if not env_ids:
        return slice(0, 0)
    first = env_ids[0]
    stop = first + len(env_ids)
    if env_ids[-1] == stop - 1 and tuple(env_ids) == tuple(range(first, stop)):
        return slice(first, stop)
    return np.asarray(env_ids, dtype=np.intp)


def _close_quietly(env: Any) -> None:
    """Close an env built too late to be used (its rebuild was abandoned)."""
    try:
        env.close()
    except BaseException:  # a daemon thread's last act: nothing to report to
        pass
