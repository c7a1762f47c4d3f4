"""Pinning workers to CPUs: ``envfleet.make(..., cpu_affinity=...)``.

Why a pool would pin its workers: envs that mostly wait (a 1 ms sleep, I/O) on the thread
backend hand the GIL from thread to thread about twice per env per step. When those threads
share one core each hand-off is a plain context switch; spread over several cores, each is a
wake-up of another core, which costs far more on a virtual machine. Packing the env threads on
one core (and leaving the others to the pool's thread and the learner) measured 0.75 vs 0.65
of the ideal rate on a 2-core VM with a bare harness, 32 threads of a 1 ms sleep.

The CPUs are applied inside each worker, wherever it runs (a thread of this process, a worker
process, a Ray actor), by :func:`pin_worker`, which ``envfleet.worker.build_group`` calls
before building the envs; threads the worker starts later (``threads_per_worker``) inherit
them. Only the worker's own thread is pinned (Linux ``sched_setaffinity`` on the calling
thread), never the caller's.

Accepted values (:data:`CpuAffinity`):

- ``None``: no pinning (the default);
- ``"spread"``: worker ``w`` on the ``w % n``-th of the ``n`` CPUs the worker may use, one
  core each, as EnvPool's ``thread_affinity_offset=0``;
- a sequence of CPU ids, e.g. ``[1]``: every worker may run on those CPUs only;
- a sequence of such sequences, e.g. ``[[0], [1]]``: worker ``w`` gets entry
  ``w % len(cpu_affinity)``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, TypeGuard

import numpy as np

CpuAffinity: TypeAlias = Literal["spread"] | Sequence[int] | Sequence[Sequence[int]]
"""What ``cpu_affinity`` accepts (besides ``None``)."""

SPREAD: Literal["spread"] = "spread"

Affinity: TypeAlias = Literal["spread"] | tuple[tuple[int, ...], ...]
"""A checked ``cpu_affinity``: ``"spread"`` or CPU sets, one per worker, cycled."""


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this thread may run on, in order (all of them where the OS cannot tell).

    ``len(usable_cpus())`` is how many cores a pool, a benchmark or ``envfleet tune`` may
    count on; it is never empty.
    """
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return tuple(range(os.cpu_count() or 1))


def check_affinity(value: object, *, check_usable: bool = True) -> Affinity | None:
    """``cpu_affinity`` as given to :func:`envfleet.make`, checked and normalised.

    Args:
        value: the caller's value.
        check_usable: also check that every CPU named is one this process may use (off for
            workers on other machines, which check their own on start).

    Raises:
        TypeError, ValueError: the value has the wrong form or names CPUs not usable here.
    """
    if value is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(
            f"cpu_affinity={value!r} needs os.sched_setaffinity, which this platform lacks "
            "(Linux has it); leave cpu_affinity=None here"
        )
    if isinstance(value, str):
        if value != SPREAD:
            raise ValueError(
                f"cpu_affinity={value!r} is not understood: expected None, 'spread', a "
                "sequence of CPU ids or a sequence of such sequences"
            )
        return SPREAD
    entries = _sequence(value, value)
    if not entries:
        raise ValueError("cpu_affinity=[] names no CPU: give at least one CPU id")
    if not any(_is_cpu_set(entry) for entry in entries):
        sets: tuple[tuple[int, ...], ...] = (_cpus(entries, value),)
    else:
        sets = tuple(_cpus(_sequence(entry, value), value) for entry in entries)
    if check_usable:
        usable = usable_cpus()
        bad = sorted({cpu for cpus in sets for cpu in cpus} - set(usable))
        if bad:
            raise ValueError(
                f"cpu_affinity={_show(value)} names CPUs {bad} that this process may not use; "
                f"usable CPUs: {list(usable)}"
            )
    return sets


def cpus_for(affinity: Affinity, worker: int, usable: Sequence[int]) -> tuple[int, ...]:
    """The CPUs worker ``worker`` runs on under ``affinity``."""
    if isinstance(affinity, str):  # "spread"
        return (usable[worker % len(usable)],)
    return affinity[worker % len(affinity)]


def pin_worker(affinity: Affinity | None, worker: int) -> None:
    """Pin the calling thread (a worker's) to its CPUs; nothing when ``affinity`` is None.

    Raises:
        ValueError: the CPUs are not ones this worker may use (on another Ray node, say).
    """
    if affinity is None:
        return
    usable = usable_cpus()
    cpus = cpus_for(affinity, worker, usable)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise ValueError(
            f"cannot pin worker {worker} to CPUs {list(cpus)} (cpu_affinity): {exc}; "
            f"usable CPUs here: {list(usable)}"
        ) from exc


def _is_cpu(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_cpu_set(value: object) -> TypeGuard[Sequence[object] | set[object] | frozenset[object]]:
    return not isinstance(value, str | bytes) and isinstance(value, Sequence | set | frozenset)


def _sequence(value: object, whole: object) -> list[object]:
    if not _is_cpu_set(value):
        raise TypeError(
            f"cpu_affinity must be None, 'spread', a sequence of CPU ids or a sequence of such "
            f"sequences (one per worker, cycled); got {_show(whole)}"
        )
    return list(value)


def _cpus(entries: Sequence[object], whole: object) -> tuple[int, ...]:
    if not entries:
        raise ValueError(f"cpu_affinity={_show(whole)} has an empty CPU set")
    cpus: set[int] = set()
    for entry in entries:
        if not _is_cpu(entry):
            raise TypeError(
                f"cpu_affinity={_show(whole)}: CPU ids must be ints, got {entry!r} "
                f"({type(entry).__name__})"
            )
        if int(entry) < 0:
            raise ValueError(f"cpu_affinity={_show(whole)}: CPU ids are >= 0, got {entry}")
        cpus.add(int(entry))
    return tuple(sorted(cpus))


def _show(value: object) -> str:
    if isinstance(value, set | frozenset):
        return repr(sorted(value))
    return repr(value)


__all__ = [
    "SPREAD",
    "Affinity",
    "CpuAffinity",
    "check_affinity",
    "cpus_for",
    "pin_worker",
    "usable_cpus",
]
