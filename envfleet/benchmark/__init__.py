"""Side-by-side throughput benchmark: the engine behind ``envfleet bench`` and ``bench/``.

A *runner* is one way of stepping ``num_envs`` copies of an env (:data:`RUNNERS`), opened by
``RUNNERS[name].open(workload, timing)``; each :meth:`Runner.window` steps for some seconds and
returns env-steps per second, with actions sampled before the clock starts. :func:`measure`
opens runners on one workload (a script's own too, ``openers``) and interleaves their windows,
so that load from elsewhere hits them alike; the median window is reported, and a ratio of two
runners is the median of their per-round ratios (:meth:`RunResult.over`). :func:`sweep` does
that per env count and returns a :class:`Report`: a table (:func:`report_table`,
:func:`startup_table`), a plot (:func:`write_plot`) and JSON (:func:`write_json`).

It needs the ``cli`` extra (rich for the tables, matplotlib for the plot):
``pip install 'envfleet[cli]'``; without rich, importing it says so.
"""

import importlib.util

if importlib.util.find_spec("rich") is None:  # the cli extra
    raise ImportError("envfleet.benchmark needs rich: pip install 'envfleet[cli]'", name="rich")

# Re-exported (``name as name``: the names this package offers, for readers and type checkers).
from envfleet.benchmark.bare import BARE_NODES as BARE_NODES
from envfleet.benchmark.bare import BARE_POOL as BARE_POOL
from envfleet.benchmark.bare import open_bare_nodes as open_bare_nodes
from envfleet.benchmark.bare import open_bare_pool as open_bare_pool
from envfleet.benchmark.base import OK as OK
from envfleet.benchmark.base import CallRunner as CallRunner
from envfleet.benchmark.base import Runner as Runner
from envfleet.benchmark.base import RunResult as RunResult
from envfleet.benchmark.base import Skipped as Skipped
from envfleet.benchmark.base import Timing as Timing
from envfleet.benchmark.base import Workload as Workload
from envfleet.benchmark.base import cycle as cycle
from envfleet.benchmark.base import open_vector as open_vector
from envfleet.benchmark.base import sample_actions as sample_actions
from envfleet.benchmark.measure import machine_info as machine_info
from envfleet.benchmark.measure import measure as measure
from envfleet.benchmark.measure import sweep as sweep
from envfleet.benchmark.peers import ale_vector_options as ale_vector_options
from envfleet.benchmark.peers import open_ale_vector as open_ale_vector
from envfleet.benchmark.peers import open_envpool as open_envpool
from envfleet.benchmark.peers import open_pufferlib as open_pufferlib
from envfleet.benchmark.peers import open_sb3 as open_sb3
from envfleet.benchmark.registry import RUNNERS as RUNNERS
from envfleet.benchmark.registry import Availability as Availability
from envfleet.benchmark.registry import RunnerKind as RunnerKind
from envfleet.benchmark.registry import availability as availability
from envfleet.benchmark.registry import parse_runners as parse_runners
from envfleet.benchmark.report import Column as Column
from envfleet.benchmark.report import Report as Report
from envfleet.benchmark.report import plot_label as plot_label
from envfleet.benchmark.report import report_notes as report_notes
from envfleet.benchmark.report import report_table as report_table
from envfleet.benchmark.report import startup_table as startup_table
from envfleet.benchmark.report import write_json as write_json
from envfleet.benchmark.report import write_plot as write_plot
from envfleet.benchmark.runners import CeilingRunner as CeilingRunner
from envfleet.benchmark.runners import envfleet_opener as envfleet_opener
from envfleet.benchmark.runners import open_envfleet as open_envfleet
from envfleet.benchmark.runners import open_gym_async as open_gym_async
from envfleet.benchmark.runners import open_loop as open_loop
from envfleet.benchmark.wakeups import describe_wakes as describe_wakes
from envfleet.benchmark.wakeups import wake_round_trips as wake_round_trips
