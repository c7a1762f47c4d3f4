"""What a wake-up costs on this machine now: a pipe's round trip on one core and across two.

Every vector step of a pool is a chain of wake-ups (the pool wakes its workers, the last worker
wakes the pool; across nodes through each node's agent), so what one costs sets how fast a step
of cheap envs can be. On a virtual machine, waking an idle core costs the host an interrupt to
a halted virtual CPU, which a busy host may serve late (tens of times a wake-up on one core).
Recorded with each run (:func:`~envfleet.benchmark.measure.machine_info`), it tells apart runs
between which the machine itself changed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from typing import Any

from envfleet.affinity import usable_cpus

_GO, _STOP, _DONE = b"g", b"s", b"d"


def _echo(cpu: int, commands: Any, replies: Any) -> None:
    """The far end: on ``cpu``, a byte back for each byte in, until told to stop."""
    os.sched_setaffinity(0, {cpu})
    inbox, outbox = commands.fileno(), replies.fileno()
    os.write(outbox, _DONE)
    while os.read(inbox, 1) == _GO:
        os.write(outbox, _DONE)


def wake_round_trips(rounds: int = 5, round_trips: int = 400) -> dict[str, float] | None:
    """Median microseconds of a one-byte round trip between this thread and a process blocked
    on a pipe, that process on this thread's core and on another (``rounds`` of
    ``round_trips`` each, the two alternated); ``None`` where the process cannot be pinned or
    has one core. This thread's affinity is as it was afterwards."""
    cpus = usable_cpus()
    if len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    here = cpus[0]
    ctx = multiprocessing.get_context("spawn")  # no copy of the caller's threads
    before = os.sched_getaffinity(0)
    ends: dict[str, tuple[int, int]] = {}
    procs: list[Any] = []
    conns: list[Any] = []
    times: dict[str, list[float]] = {"same core": [], "across cores": []}
    try:
        for key, far in (("same core", here), ("across cores", cpus[1])):
            command_r, command_w = ctx.Pipe(duplex=False)
            reply_r, reply_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_echo, args=(far, command_r, reply_w), daemon=True)
            proc.start()
            procs.append(proc)
            command_r.close()
            reply_w.close()
            conns += [command_w, reply_r]
            ends[key] = command_w.fileno(), reply_r.fileno()
        for _, inbox in ends.values():
            if os.read(inbox, 1) != _DONE:
                return None
        os.sched_setaffinity(0, {here})
        for _ in range(rounds):
            for key, (outbox, inbox) in ends.items():
                start = time.perf_counter()
                for _ in range(round_trips):
                    os.write(outbox, _GO)
                    if not os.read(inbox, 1):  # the far end is gone: no figure
                        return None
                times[key].append((time.perf_counter() - start) / round_trips * 1e6)
    except OSError:  # pinning refused (a container's cpuset changed under us), or a child gone
        return None
    finally:
        os.sched_setaffinity(0, before)
        for outbox, _ in ends.values():
            with contextlib.suppress(OSError):  # that child is gone already
                os.write(outbox, _STOP)
        for proc in procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    return {key: round(statistics.median(values), 1) for key, values in times.items()}


def describe_wakes(*measured: dict[str, float] | None) -> str | None:
    """What :func:`wake_round_trips` measured, once or more (before and after a run), in words:
    ``"7.6 and 7.4 us on one core, 91.7 and 72.4 us across two"``; ``None`` if one of them is."""
    if not measured or not all(measured):
        return None
    same, across = (
        " and ".join(f"{m[key]:g}" for m in measured if m) for key in ("same core", "across cores")
    )
    return f"{same} us on one core, {across} us across two"


__all__ = ["describe_wakes", "wake_round_trips"]
