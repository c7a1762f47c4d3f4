"""Side-by-side throughput benchmark: the engine behind ``envfleet bench`` and ``bench/``.

A *runner* is one way of stepping ``num_envs`` copies of an env (:data:`RUNNERS`: a for-loop,
the independent-processes ceiling, the bare pool, envfleet's backends, Gymnasium's vector envs
and the peers that are installed), opened by ``RUNNERS[name].open(workload, timing)``; each
:meth:`Runner.window` steps for some seconds and returns env-steps per second, with actions
sampled before the clock starts. :func:`measure` opens runners on one workload (a script's own
too, ``openers``) and interleaves their windows, so that load from elsewhere hits them alike;
the median window is reported. :func:`sweep` does that per env count and returns a
:class:`Report`: a table (:func:`report_table`, :func:`startup_table`), a plot
(:func:`write_plot`) and JSON (:func:`write_json`).

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
    Column,
    Report,
    plot_label,
    report_notes,
    report_table,
    startup_table,
    write_json,
    write_plot,
)
from envfleet.benchmark.runners import (
    CeilingRunner,
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
    "CeilingRunner",
    "Column",
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
