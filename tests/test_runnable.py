"""The machine's count of running and queued tasks, which decides whether a pool may spin."""

from __future__ import annotations

from pathlib import Path

import pytest

from envfleet.backends.local import runnable as runnable_module
from envfleet.backends.local.runnable import FRESH, LOADAVG, Runnable


@pytest.mark.skipif(not Path(LOADAVG).exists(), reason="Linux's /proc/loadavg only")
def test_counts_this_process_among_the_running_tasks() -> None:
    runnable = Runnable()
    try:
        assert runnable.count() >= 1  # the caller is running while it reads
    finally:
        runnable.close()


@pytest.mark.parametrize(
    ("text", "count"),
    [
        (b"0.29 1.15 1.45 3/245 12345\n", 3),
        (b"12.00 9.10 4.30 17/1021 99\n", 17),
        (b"", 0),  # unreadable: 0, never a reason not to spin
        (b"0.29 1.15 1.45 x/245 1\n", 0),
    ],
)
def test_reads_the_fourth_field_of_loadavg(tmp_path: Path, text: bytes, count: int) -> None:
    path = tmp_path / "loadavg"
    path.write_bytes(text)
    runnable = Runnable(str(path))
    try:
        assert runnable.count() == count
        path.write_bytes(b"0.00 0.00 0.00 5/100 7\n")  # read afresh at every call
        assert runnable.count() == 5
    finally:
        runnable.close()


@pytest.mark.parametrize(
    ("count", "tasks", "cores", "only"),
    [(2, 2, 2, True), (3, 3, 2, True), (3, 2, 2, False), (4, 3, 2, False), (8, 2, 8, True)],
)
def test_only_the_callers_tasks_or_a_core_for_each(
    tmp_path: Path, count: int, tasks: int, cores: int, only: bool
) -> None:
    path = tmp_path / "loadavg"
    path.write_bytes(f"1.00 1.00 1.00 {count}/100 7\n".encode())
    runnable = Runnable(str(path))
    try:
        assert runnable.only(tasks, cores) is only
    finally:
        runnable.close()


def test_without_the_file_it_never_says_busy(tmp_path: Path) -> None:
    runnable = Runnable(str(tmp_path / "missing"))
    assert runnable.count() == 0
    assert runnable.only(1, 1)
    runnable.close()
    runnable.close()  # idempotent


def test_only_reads_the_count_at_most_once_per_fresh_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "loadavg"
    path.write_bytes(b"1.00 1.00 1.00 2/100 7\n")
    clock = [100.0]
    monkeypatch.setattr(runnable_module.time, "monotonic", lambda: clock[0])
    runnable = Runnable(str(path))
    try:
        assert runnable.only(2, 2)
        path.write_bytes(b"1.00 1.00 1.00 9/100 7\n")  # the machine got busy
        clock[0] += FRESH / 2
        assert runnable.only(2, 2)  # the count read a moment ago still answers
        clock[0] += FRESH
        assert not runnable.only(2, 2)  # read again: busy
    finally:
        runnable.close()
