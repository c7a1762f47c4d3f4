"""Recovery's decisions on their own, and the dispatch carrying them out over a fake transport
that records what it is asked to do."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

from envfleet import recovery as recovery_module
from envfleet.backends import WorkerLost
from envfleet.dispatch import Dispatch
from envfleet.errors import (
    EnvRaisedError,
    EnvTimeoutError,
    OnError,
    Phase,
    RestartLimitError,
    WorkerDiedError,
)
from envfleet.ledger import EnvState, Ledger
from envfleet.protocol import Call, Command, EnvFailure, Reply, Step
from envfleet.recovery import Rebuild, Recovery
from envfleet.stats import StatsRecorder

ASSIGNMENT = [(0, 1), (2, 3)]


class FakeTransport:
    """Scripted replies; records submits, kills and restarts (it is its own workers)."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, Command]] = []
        self.killed: list[int] = []
        self.restarted: list[tuple[int, dict[int, int]]] = []
        self.replies: deque[tuple[int, Reply | WorkerLost | None]] = deque()
        self.batch: Any = None

    @property
    def workers(self) -> FakeTransport:
        return self

    def submit(self, worker: int, command: Command) -> None:
        self.submitted.append((worker, command))

    def submit_many(self, commands: list[tuple[int, Command]]) -> None:
        self.submitted.extend(commands)

    def prepare(self, worker: int, command: Command) -> None:
        pass

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        replies = list(self.replies)
        self.replies.clear()
        return replies

    def kill(self, worker: int) -> None:
        self.killed.append(worker)

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.restarted.append((worker, restarts))

    def close(self, timeout: float) -> None:
        pass


def setup(**kwargs: Any) -> tuple[Ledger, FakeTransport, Recovery]:
    ledger = Ledger(ASSIGNMENT, StatsRecorder(ASSIGNMENT, 4))
    transport = FakeTransport()
    recovery = Recovery(ledger, env_name="Fake-v0", **kwargs)
    return ledger, transport, recovery


class Face:
    """What the dispatch gathers a failing call's completed results from (held weakly)."""

    def __init__(self) -> None:
        self.gathered: list[list[int]] = []

    def gather(self, env_ids: np.ndarray) -> Any:
        self.gathered.append(env_ids.tolist())
        return ("results", env_ids)


def dispatching(
    ledger: Ledger, transport: FakeTransport, recovery: Recovery, face: Face
) -> Dispatch:
    return Dispatch(transport, ledger, recovery, "Fake-v0", face.gather)  # type: ignore[arg-type]


def failure(env: int | None, phase: Phase = Phase.STEP) -> EnvFailure:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        return EnvFailure.capture(env, phase, exc)


LOST = WorkerLost(-9, "killed by SIGKILL")


def test_lost_worker_under_raise_names_its_envs_and_phase() -> None:
    ledger, transport, recovery = setup()
    ledger.sent(1, Step((2, 3)))
    error = recovery.take(1, LOST)
    assert isinstance(error, WorkerDiedError)
    assert (error.worker, error.phase, error.env_index, error.env_ids) == (1, Phase.STEP, 2, (2, 3))
    assert "killed by SIGKILL" in str(error)
    assert not transport.restarted and not ledger.pending[1]
    assert ledger.state[2:].tolist() == [EnvState.IDLE] * 2


def test_lost_worker_under_restart_is_rebuilt_and_its_commands_resent() -> None:
    ledger, transport, recovery = setup(on_error=OnError.RESTART)
    face = Face()
    dispatch = dispatching(ledger, transport, recovery, face)
    step, call = Step((2, 3)), Call("render")
    ledger.sent(1, step)
    ledger.sent(1, call)
    assert recovery.take(1, LOST) == Rebuild(1, {2: 1, 3: 1}, (step, call))  # decided only
    assert transport.restarted == [] and transport.submitted == []
    ledger.sent(1, step)
    ledger.sent(1, call)
    recovery.restarts[:] = 0
    transport.replies.append((1, LOST))
    dispatch.pump(block=False)  # the dispatch carries it out
    assert transport.restarted == [(1, {2: 1, 3: 1})]
    assert transport.submitted == [(1, step), (1, call)]
    assert list(ledger.pending[1]) == [step, call]
    assert ledger.state[2:].tolist() == [EnvState.IN_FLIGHT] * 2
    assert recovery.restarts.tolist() == [0, 0, 1, 1]


def test_restart_limit_stops_restarting() -> None:
    ledger, _, recovery = setup(on_error=OnError.RESTART, max_restarts=1)
    for expected in (Rebuild, RestartLimitError):
        ledger.sent(0, Step((0, 1)))
        error = recovery.take(0, LOST)
        assert isinstance(error, expected)
    assert isinstance(error, RestartLimitError) and error.env_index == 0
    assert isinstance(error.__cause__, WorkerDiedError)


def test_env_restarts_reported_by_a_group_count_against_the_limit() -> None:
    ledger, _, recovery = setup(on_error=OnError.RESTART, max_restarts=1)
    ledger.sent(0, Step((0, 1)))
    assert recovery.take(0, Reply(env_ids=(0, 1), restarts=(failure(1),))) is None
    ledger.collected(np.array([0, 1]))
    ledger.sent(0, Step((0, 1)))
    error = recovery.take(0, Reply(env_ids=(0, 1), restarts=(failure(1),)))
    assert isinstance(error, RestartLimitError) and error.env_index == 1


def test_a_failed_env_is_an_error_and_goes_idle() -> None:
    ledger, _, recovery = setup()
    ledger.sent(0, Step((0, 1)))
    error = recovery.take(0, Reply(env_ids=(0, 1), failures=(failure(0),)))
    assert isinstance(error, EnvRaisedError) and (error.env_index, error.worker) == (0, 0)
    assert ledger.state[:2].tolist() == [EnvState.IDLE, EnvState.READY]


def test_hung_worker_is_killed_and_reported_as_timed_out() -> None:
    ledger, _, recovery = setup(step_timeout=5.0)
    assert recovery.wait_timeout() is None  # nothing owed: no bound
    ledger.sent(0, Step((0, 1)))
    assert 0 < recovery.wait_timeout() <= 5.0  # type: ignore[operator]
    assert recovery.hung() == []  # not yet
    ledger.busy_since[0] -= 10.0  # as if it had owed the reply for 10 s
    assert recovery.wait_timeout() == 0.0
    assert recovery.hung() + recovery.hung() == [0]  # once
    # Killed, not yet reported lost (a stopped Ray actor takes Ray seconds): the pool waits
    # for the loss in slices, without spinning on a deadline already past.
    assert recovery.wait_timeout() == pytest.approx(recovery_module.HUNG_POLL, abs=0.01)
    ledger.sent(1, Step((2, 3)))  # another worker's own deadline still counts
    ledger.busy_since[1] -= 5.0 - recovery_module.HUNG_POLL / 2
    assert 0 < recovery.wait_timeout() < recovery_module.HUNG_POLL  # type: ignore[operator]
    error = recovery.take(0, WorkerLost(-9, "killed by SIGKILL"))
    assert isinstance(error, EnvTimeoutError) and error.phase is Phase.STEP
    assert "hung" in str(error) and "step_timeout=5.0" in str(error)


def test_fail_breaks_the_pool_and_gathers_what_completed() -> None:
    ledger, transport, recovery = setup()
    ledger.sent(0, Step((0, 1)))
    ledger.sent(1, Step((2, 3)))
    error = recovery.take(0, Reply(env_ids=(0, 1), failures=(failure(1),)))
    assert error is not None
    transport.replies.append((1, None))  # worker 1's step comes in while draining
    face = Face()
    dispatch = dispatching(ledger, transport, recovery, face)
    assert isinstance(error, EnvRaisedError)
    with pytest.raises(EnvRaisedError) as raised:
        dispatch.fail(error)
    assert raised.value is error and recovery.broken is error
    assert face.gathered == [[0, 2, 3]]
    assert error.completed[0] == "results"  # type: ignore[index]
    assert ledger.state.tolist() == [EnvState.IDLE] * 4


def test_a_rebuilds_time_does_not_count_against_the_other_workers_step_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker 0 is rebuilt for 10 s (the pool reads nothing meanwhile): worker 1, which owed a
    reply for 1 s before it, is not past a 5 s ``step_timeout`` after it."""
    ledger, transport, recovery = setup(on_error=OnError.RESTART, step_timeout=5.0)
    face = Face()
    dispatch = dispatching(ledger, transport, recovery, face)
    clock = [100.0]
    for module in ("envfleet.recovery", "envfleet.ledger", "envfleet.dispatch"):
        monkeypatch.setattr(f"{module}.time.monotonic", lambda: clock[0])

    def slow_restart(worker: int, restarts: dict[int, int]) -> None:
        clock[0] += 10.0
        transport.restarted.append((worker, restarts))

    monkeypatch.setattr(transport, "restart", slow_restart)
    ledger.sent(0, Step((0, 1)))
    ledger.sent(1, Step((2, 3)))
    clock[0] += 1.0
    transport.replies.append((0, LOST))
    dispatch.pump(block=False)  # rebuilt, its step resent
    assert transport.restarted == [(0, {0: 1, 1: 1})] and transport.killed == []
    assert not recovery.overdue()
    assert recovery.wait_timeout() == pytest.approx(4.0)  # worker 1: 5 s less the 1 s it owed
    clock[0] += 4.5  # now past: 5.5 s of its own time, the rebuild not counted
    assert recovery.overdue()
    dispatch.pump(block=False)
    assert transport.killed == [1]
    recovery.on_error = OnError.RAISE
    error = recovery.take(1, LOST)  # named hung for its own 5.5 s, not the rebuild's 15.5
    assert isinstance(error, EnvTimeoutError) and "no reply after 5.5s" in str(error)


def test_a_reply_that_arrived_is_read_before_its_worker_is_judged_hung(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker 1 is past ``step_timeout`` by the clock, but its reply is in: the dispatch reads
    it before it asks who hangs, and kills nobody."""
    ledger, transport, recovery = setup(on_error=OnError.RESTART, step_timeout=5.0)
    face = Face()
    dispatch = dispatching(ledger, transport, recovery, face)
    clock = [100.0]
    for module in ("envfleet.recovery", "envfleet.ledger", "envfleet.dispatch"):
        monkeypatch.setattr(f"{module}.time.monotonic", lambda: clock[0])
    waits: list[float | None] = []
    replies = iter([[], [(1, None)]])  # nothing the first time it waits; then worker 1's

    def wait(timeout: float | None, want: int = 1) -> list[Any]:
        waits.append(timeout)
        clock[0] += 6.0
        return next(replies, [])

    monkeypatch.setattr(transport, "wait", wait)
    ledger.sent(1, Step((2, 3)))
    dispatch.pump(block=True)
    assert waits == [5.0, 0.0]  # the bound, then a look at what arrived, without waiting
    assert transport.killed == [] and not ledger.pending[1]
    assert ledger.state[2:].tolist() == [EnvState.READY] * 2
