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

# Every public name of the submodules (each module's ``__all__``), as asyncio gathers its own.
from envfleet.benchmark import bare, base, collect, cpu, peers, registry, report, runners, wakeups
from envfleet.benchmark import measure as _measure  # `measure` is its function, below
from envfleet.benchmark.bare import *  # noqa: F403
from envfleet.benchmark.base import *  # noqa: F403
from envfleet.benchmark.collect import *  # noqa: F403
from envfleet.benchmark.cpu import *  # noqa: F403
from envfleet.benchmark.measure import *  # noqa: F403
from envfleet.benchmark.peers import *  # noqa: F403
from envfleet.benchmark.registry import *  # noqa: F403
from envfleet.benchmark.report import *  # noqa: F403
from envfleet.benchmark.runners import *  # noqa: F403
from envfleet.benchmark.wakeups import *  # noqa: F403

__all__ = [
    *bare.__all__,
    *base.__all__,
    *collect.__all__,
    *cpu.__all__,
    *_measure.__all__,
    *peers.__all__,
    *registry.__all__,
    *report.__all__,
    *runners.__all__,
    *wakeups.__all__,
]
