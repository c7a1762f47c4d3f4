"""The ledger on its own: per-env states, pending commands per worker, the ready FIFO."""

from __future__ import annotations

import numpy as np
import pytest

from envfleet.errors import Phase
from envfleet.ledger import EnvState, Ledger
from envfleet.protocol import Call, Close, EnvFailure, Reply, Reset, SetAttr, Step
from envfleet.stats import StatsRecorder

ASSIGNMENT = [(0, 1, 2), (3, 4)]


def make_ledger() -> Ledger:
    return Ledger(ASSIGNMENT, StatsRecorder(ASSIGNMENT, 5))


def states(ledger: Ledger) -> list[EnvState]:
    return [EnvState(s) for s in ledger.state.tolist()]


def failure(env: int) -> EnvFailure:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        return EnvFailure.capture(env, Phase.STEP, exc)


def test_step_goes_idle_in_flight_ready_idle() -> None:
    ledger = make_ledger()
    assert states(ledger) == [EnvState.IDLE] * 5
    ledger.sent(1, Step((3, 4)))
    assert states(ledger) == [EnvState.IDLE] * 3 + [EnvState.IN_FLIGHT] * 2
    assert ledger.in_flight == 2 and ledger.owed() == 2
    assert ledger.busy(np.arange(5)).tolist() == [3, 4]
    assert ledger.any_in_flight(np.array([3])) and not ledger.any_in_flight(np.array([0]))
    command = ledger.took(1, None)
    assert command == Step((3, 4))
    assert states(ledger)[3:] == [EnvState.READY] * 2 and ledger.in_flight == 0
    assert list(ledger.ready) == [3, 4]
    assert ledger.handed_out(2).tolist() == [3, 4]
    assert states(ledger) == [EnvState.IDLE] * 5 and ledger.owed() == 0


def test_ready_fifo_follows_reply_order_across_workers() -> None:
    ledger = make_ledger()
    ledger.sent(0, Step((0, 1, 2)))
    ledger.sent(1, Step((3, 4)))
    ledger.took(1, None)  # worker 1 answers first
    ledger.took(0, Reply(env_ids=(0, 1, 2), infos={1: {"x": 1}}))
    assert list(ledger.ready) == [3, 4, 0, 1, 2]
    assert ledger.infos == {1: {"x": 1}}
    assert ledger.handed_out(3).tolist() == [3, 4, 0]
    ready, idle = EnvState.READY, EnvState.IDLE
    assert states(ledger) == [idle, ready, ready, idle, idle]  # 1, 2 wait
    ledger.collected(np.array([2]))  # taken out of the FIFO whatever its place
    assert list(ledger.ready) == [1]


def test_pending_per_worker_in_order_and_replies_answer_the_head() -> None:
    ledger = make_ledger()
    first, second = Reset((0,), (7,)), Step((1, 2))
    ledger.sent(0, first)
    ledger.sent(0, second)
    assert list(ledger.pending[0]) == [first, second] and not ledger.pending[1]
    assert ledger.took(0, None) is first
    assert states(ledger)[:3] == [EnvState.READY, EnvState.IN_FLIGHT, EnvState.IN_FLIGHT]
    assert ledger.took(0, None) is second
    assert not ledger.pending[0]


def test_failed_envs_go_idle_not_ready() -> None:
    ledger = make_ledger()
    ledger.sent(0, Step((0, 1, 2)))
    ledger.took(0, Reply(env_ids=(0, 1, 2), failures=(failure(1),)))
    assert states(ledger)[:3] == [EnvState.READY, EnvState.IDLE, EnvState.READY]
    assert list(ledger.ready) == [0, 2] and ledger.in_flight == 0


def test_call_replies_are_filed_under_the_command_object() -> None:
    ledger = make_ledger()
    # Equal calls are still two commands: each reply goes to the one it answers.
    a, b = Call("render"), Call("render")
    assert a != b and len({a, b}) == 2
    ledger.sent(0, a)
    ledger.sent(1, b)
    ledger.took(1, Reply(values={3: "b"}))
    ledger.took(0, None)
    assert ledger.answers[b].values == {3: "b"} and ledger.answers[a] == Reply()
    assert states(ledger) == [EnvState.IDLE] * 5  # a call delivers no env


def test_lost_worker_drops_what_it_owed_and_returns_what_to_resend() -> None:
    ledger = make_ledger()
    step, call, close = Step((3, 4)), SetAttr("x", {3: 1, 4: 2}), Close()
    for command in (step, call, close):
        ledger.sent(1, command)
    ledger.sent(0, Step((0,)))
    assert ledger.in_flight_of(1) == [3, 4]
    assert ledger.dropped(1) == [step, call]  # a Close is never resent
    assert not ledger.pending[1] and ledger.in_flight == 1
    assert states(ledger)[3:] == [EnvState.IDLE] * 2
    assert not ledger.idle_worker(0) and ledger.idle_worker(1)


def test_whole_pool_path_books_every_worker_at_once() -> None:
    ledger = make_ledger()
    assert ledger.sent_all()  # nothing owed before: replies may be taken all at once
    assert ledger.all_out is not None and ledger.in_flight == 5
    assert [list(q) for q in ledger.pending] == [[c] for c in ledger.step_all]
    ledger.took_all_plain([1, 0])
    assert ledger.all_out is None and ledger.in_flight == 0
    assert list(ledger.ready) == [3, 4, 0, 1, 2]  # in the order the workers answered
    assert states(ledger) == [EnvState.READY] * 5 and not any(ledger.pending)
    ledger.collected(ledger.all_ids)
    assert states(ledger) == [EnvState.IDLE] * 5 and not ledger.ready
    # The same commands every step (a transport pickles them once).
    step_all = ledger.step_all
    ledger.sent_all()
    assert all(q[0] is c for q, c in zip(ledger.pending, step_all, strict=True))


def test_whole_pool_step_behind_a_pending_command_is_not_taken_at_once() -> None:
    ledger = make_ledger()
    ledger.sent(0, Call("render"))
    assert not ledger.sent_all() and ledger.all_out is None
    assert len(ledger.pending[0]) == 2 and len(ledger.pending[1]) == 1
    ledger.took(0, None)  # the call
    ledger.took(0, None)
    ledger.took(1, None)
    assert list(ledger.ready) == [0, 1, 2, 3, 4]


def test_any_reply_ends_the_whole_pool_shortcut() -> None:
    ledger = make_ledger()
    ledger.sent_all()
    ledger.took(0, None)
    assert ledger.all_out is None  # the others are then taken one by one
    ledger.took(1, None)
    assert ledger.in_flight == 0


@pytest.mark.parametrize("ids", [[4, 0, 3], [1], [0, 1, 2, 3, 4]])
def test_by_worker_groups_sorted(ids: list[int]) -> None:
    ledger = make_ledger()
    groups = ledger.by_worker(np.array(ids))
    assert [w for w, _ in groups] == sorted({0 if i < 3 else 1 for i in ids})
    assert sorted(i for _, g in groups for i in g) == sorted(ids)
    assert all(list(g) == sorted(g) for _, g in groups)


def test_commands_name_their_phase_and_kind() -> None:
    from envfleet.protocol import EnvCommand, ValueCommand

    assert (Step.phase, Reset.phase, Call.phase, SetAttr.phase, Close.phase) == (
        Phase.STEP,
        Phase.RESET,
        Phase.CALL,
        Phase.CALL,
        Phase.CLOSE,
    )
    assert isinstance(Step((0,)), EnvCommand) and isinstance(Reset((0,), (None,)), EnvCommand)
    assert isinstance(Call("x"), ValueCommand) and not isinstance(Close(), EnvCommand)


def test_dependencies_point_down_face_to_recovery_to_ledger() -> None:
    """The ledger imports neither recovery nor the face nor a transport; recovery neither the
    face nor the dispatch; the dispatch, under the face, not the face."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "envfleet"

    def imports(name: str) -> set[str]:
        tree = ast.parse((root / name).read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return {m for m in found if m.startswith("envfleet")}

    # Beside the vocabulary and the figures, only the format infos take as columns.
    assert imports("ledger.py") <= {"envfleet.protocol", "envfleet.stats", "envfleet.info_columns"}
    assert not {"envfleet.pool", "envfleet.dispatch"} & imports("recovery.py")
    assert "envfleet.pool" not in imports("dispatch.py")
    assert {"envfleet.ledger", "envfleet.recovery"} <= imports("dispatch.py")
    # The face's parts are wired in pool_parts.py, which the face imports.
    assert "envfleet.pool_parts" in imports("pool.py")
    assert {"envfleet.ledger", "envfleet.recovery", "envfleet.dispatch"} <= imports("pool_parts.py")
    assert not {"envfleet.pool", "envfleet.pool_parts"} & imports("dispatch.py")


def test_whole_pool_steps_recorded_lazily_match_per_worker_replies() -> None:
    """replied_all's deferred figures equal those of the same replies taken one by one."""
    assignment = [(0, 1), (2,), (3, 4, 5)]
    lazy, eager = StatsRecorder(assignment, 6), StatsRecorder(assignment, 6)
    started = 100.0
    for step in range(1500):  # over one latency window: the ring wraps and folds mid-way
        now = started + 0.001 * (step % 7 + 1)
        lazy.busy_all(started)
        lazy.replied_all(started, now)
        for worker, ids in enumerate(assignment):
            eager.busy(worker, started)
            eager.replied(worker, started, now, len(ids), True)
        if step == 700:  # a per-worker reply in between folds the pending whole-pool steps
            for rec in (lazy, eager):
                rec.busy(1, now)
                rec.replied(1, now, now + 0.5, 1, True)
        started = now
    restarts = np.zeros(6, dtype=np.int64)
    a, b = lazy.snapshot(restarts), eager.snapshot(restarts)
    assert a.steps == b.steps == 1500 * 6 + 1
    for wa, wb in zip(a.workers, b.workers, strict=True):
        assert wa.steps == wb.steps
        assert wa.latency_p50_ms == pytest.approx(wb.latency_p50_ms)
        assert wa.latency_p99_ms == pytest.approx(wb.latency_p99_ms)
    np.testing.assert_array_equal(lazy.latency, eager.latency)
    np.testing.assert_array_equal(lazy.replies, eager.replies)
    np.testing.assert_allclose(lazy.busy_seconds, eager.busy_seconds)


def test_a_whole_pool_step_answered_worker_by_worker_times_each_busy_stretch() -> None:
    """busy_all notes the start of a whole-pool step without writing it per worker; a worker
    that answers on its own (a reply with infos) still finds it, and so does the one after."""
    assignment = [(0, 1), (2,)]
    lazy, eager = StatsRecorder(assignment, 3), StatsRecorder(assignment, 3)
    lazy.busy_all(10.0)
    for worker in range(2):
        eager.busy(worker, 10.0)
    for rec in (lazy, eager):
        rec.replied(0, 10.0, 10.5, 2, True)
    np.testing.assert_array_equal(lazy.busy_start, eager.busy_start)  # worker 1: busy since 10
    busy_now = [w.idle_fraction for w in lazy.snapshot(np.zeros(3, dtype=np.int64)).workers]
    assert busy_now == [w.idle_fraction for w in eager.snapshot(np.zeros(3)).workers]
    for rec in (lazy, eager):
        rec.replied(1, 10.0, 11.0, 1, True)
    np.testing.assert_allclose(lazy.busy_seconds, [0.5, 1.0])
    np.testing.assert_allclose(lazy.busy_seconds, eager.busy_seconds)


def test_all_idle_follows_the_states() -> None:
    """all_idle reads the counters (in flight, the FIFO); they agree with the states after
    every entry: sends, plain and failed replies, a lost worker, hand-outs."""
    ledger = make_ledger()

    def agrees() -> bool:
        return ledger.all_idle() == (not ledger.state.any())

    assert ledger.all_idle()
    assert ledger.sent_all() and agrees() and not ledger.all_idle()
    ledger.took_all_plain([1, 0])
    assert agrees() and not ledger.all_idle()
    ledger.collected(ledger.all_ids)
    assert agrees() and ledger.all_idle()
    ledger.sent(0, Step((0, 1, 2)))
    ledger.sent(1, Step((3, 4)))
    ledger.took(0, Reply(env_ids=(0, 1, 2), failures=(failure(1),)))
    assert agrees() and not ledger.all_idle()
    ledger.dropped(1)
    assert agrees() and not ledger.all_idle()  # 0 and 2 wait in the FIFO
    ledger.handed_out(2)
    assert agrees() and ledger.all_idle()
    ledger.sent(1, Reset((3, 4), (None, None)))
    ledger.took(1, None)
    assert agrees() and ledger.drain_ready() is not None and agrees() and ledger.all_idle()


def test_a_whole_pool_step_collected_at_once_skips_the_ready_fifo() -> None:
    """The sync step takes every plain reply and hands every env out at once: the envs go
    straight back to idle, with nothing left in the FIFO, as the FIFO path leaves them."""
    direct, via_fifo = make_ledger(), make_ledger()
    for ledger in (direct, via_fifo):
        assert ledger.sent_all()
    direct.took_all_plain([1, 0], collected=True)
    via_fifo.took_all_plain([1, 0])
    assert list(via_fifo.ready) == [3, 4, 0, 1, 2]
    for ledger in (direct, via_fifo):
        ledger.collected(ledger.all_ids)
        assert states(ledger) == [EnvState.IDLE] * 5
        assert not ledger.ready and ledger.in_flight == 0 and ledger.all_idle()
        assert not any(ledger.pending) and ledger.all_out is None
    assert direct.sent_all()  # the next step is a whole-pool step again
