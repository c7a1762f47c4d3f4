"""What a wake-up costs (``envfleet.benchmark.wakeups``): measured on one core and across two,
with the caller's affinity left as it was."""

from __future__ import annotations

import os
from typing import Any

import pytest

from envfleet.affinity import usable_cpus
from envfleet.benchmark import wakeups


@pytest.mark.skipif(
    len(usable_cpus()) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores"
)
def test_round_trips_on_one_core_and_across_two_leave_the_affinity_as_it_was() -> None:
    before = os.sched_getaffinity(0)
    try:
        got = wakeups.wake_round_trips(rounds=2, round_trips=50)
        assert got is not None
        assert set(got) == {"same core", "across cores"}
        assert all(value > 0 for value in got.values())
        assert os.sched_getaffinity(0) == before  # pinned to one core while it measured
    finally:
        os.sched_setaffinity(0, before)


def test_one_core_has_nothing_to_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeups, "usable_cpus", lambda: (0,))
    assert wakeups.wake_round_trips() is None


def _answers_once(cpu: int, commands: Any, replies: Any) -> None:
    """A far end that says it is ready, then goes away."""
    os.write(replies.fileno(), wakeups._DONE)


@pytest.mark.skipif(
    len(usable_cpus()) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 cores"
)
def test_a_far_end_gone_mid_measurement_gives_no_figure_and_no_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.setattr(wakeups, "_echo", _answers_once)
    assert wakeups.wake_round_trips(rounds=2, round_trips=50) is None
    assert os.sched_getaffinity(0) == before


def test_figures_before_and_after_read_as_one_line() -> None:
    before = {"same core": 7.6, "across cores": 91.7}
    after = {"same core": 7.4, "across cores": 72.4}
    assert wakeups.describe_wakes(before, after) == (
        "7.6 and 7.4 us on one core, 91.7 and 72.4 us across two"
    )
    assert wakeups.describe_wakes(before) == "7.6 us on one core, 91.7 us across two"
    assert wakeups.describe_wakes(before, None) is None  # one of them has no figure
