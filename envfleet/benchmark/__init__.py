"""Side-by-side throughput benchmark: the engine behind ``envfleet bench``.

A *runner* is one way of stepping ``num_envs`` copies of an env: a plain for-loop, the
independent-processes ceiling, an envfleet backend or a peer library. It is opened with
``RUNNERS[name].open(workload, timing)``, which builds and resets its envs and warms up; each
:meth:`Runner.window` then steps for a given number of seconds and returns env-steps per second
(a vector step of ``n`` envs counts ``n``). Actions are random, sampled before the clock starts
and cycled, so sampling does not weigh on the result.

:func:`measure` opens several runners on one workload (each within
:attr:`Timing.startup_limit` seconds, if set: a runner slower to start is stopped and reported
:class:`Skipped`; its start-up time is in every result) and interleaves their windows (window 1
of every runner, then window 2, ...), so a burst of load from elsewhere on the machine hits all
runners alike instead of one; the median window is what gets reported. :func:`sweep` does that
for each ``num_envs`` of a list and returns a :class:`Report`, which renders as a table
(:func:`report_table`, and :func:`startup_table` for the start-up times), a plot
(:func:`write_plot`) and JSON (:meth:`Report.as_dict`).

Runners (:data:`RUNNERS`, each with a one-line description): ``loop`` (a for-loop in this
process), ``ceiling`` (the envs split over one process per usable core that never communicate:
what parallel stepping could reach with no coordination), ``bare-pool`` (workers woken by a
byte: the least a process pool of this design can cost), envfleet's ``serial``, ``process`` and
``thread``, Gymnasium's ``gym-sync`` and ``gym-async``, and the peers that are installed:
``sb3``, ``envpool``, ``pufferlib`` and ``ale-vector`` (ale-py's C++ ``AtariVectorEnv``, the
id's frames and frame skip). The scripts in ``bench/`` measure rows of their own with the same
:func:`measure`.

It needs the ``cli`` extra (rich for the tables, matplotlib for the plot):
``pip install 'envfleet[cli]'``; without rich, importing it says so.
"""

import importlib.util

if importlib.util.find_spec("rich") is None:  # the cli extra
    raise ImportError("envfleet.benchmark needs rich: pip install 'envfleet[cli]'", name="rich")

from envfleet.benchmark.bare import BARE_POOL, open_bare_pool
from envfleet.benchmark.base import (
    FAILED,
    LOOP,
    OK,
    CallRunner,
    OtherLoad,
    Runner,
    RunResult,
    Skipped,
    Timing,
    Workload,
    cycle,
    open_vector,
    sample_actions,
    time_calls,
)
from envfleet.benchmark.measure import machine_info, measure, sweep
from envfleet.benchmark.peers import (
    ale_vector_options,
    open_ale_vector,
    open_envpool,
    open_pufferlib,
    open_sb3,
    version,
)
from envfleet.benchmark.registry import (
    RUNNERS,
    Availability,
    RunnerKind,
    availability,
    parse_runners,
)
from envfleet.benchmark.report import (
    Report,
    plot_label,
    report_notes,
    report_table,
    startup_table,
    write_json,
    write_plot,
)
from envfleet.benchmark.runners import (
    ParallelRunner,
    envfleet_opener,
    open_envfleet,
    open_gym_async,
    open_loop,
)

__all__ = [
    "BARE_POOL",
    "FAILED",
    "LOOP",
    "OK",
    "RUNNERS",
    "Availability",
    "CallRunner",
    "OtherLoad",
    "ParallelRunner",
    "Report",
    "RunResult",
    "Runner",
    "RunnerKind",
    "Skipped",
    "Timing",
    "Workload",
    "ale_vector_options",
    "availability",
    "cycle",
    "envfleet_opener",
    "machine_info",
    "measure",
    "open_ale_vector",
    "open_bare_pool",
    "open_envfleet",
    "open_envpool",
    "open_gym_async",
    "open_loop",
    "open_pufferlib",
    "open_sb3",
    "open_vector",
    "parse_runners",
    "plot_label",
    "report_notes",
    "report_table",
    "sample_actions",
    "startup_table",
    "sweep",
    "time_calls",
    "version",
    "write_json",
    "write_plot",
]
