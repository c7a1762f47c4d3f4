"""Side-by-side throughput benchmark: the engine behind ``envfleet bench``.

A *runner* is one way of stepping ``num_envs`` copies of an env: a plain for-loop, the
independent-processes ceiling, an envfleet backend or a peer library. It is opened with
``RUNNERS[name].open(workload, timing)``, which builds and resets its envs and warms up; each
:meth:`Runner.window` then steps for a given number of seconds and returns env-steps per second
(a vector step of ``n`` envs counts ``n``). Actions are random, sampled before the clock starts
and cycled, so sampling does not weigh on the result.

:func:`measure` opens several runners on one workload and interleaves their windows (window 1
of every runner, then window 2, ...), so a burst of load from elsewhere on the machine hits all
runners alike instead of one; the median window is what gets reported. :func:`sweep` does that
for each ``num_envs`` of a list and returns a :class:`Report`, which renders as a table
(:func:`report_table`), a plot (:func:`write_plot`) and JSON (:meth:`Report.as_dict`).

Runners:

- ``loop``: a Python for-loop over the envs in this process, resetting finished ones;
- ``ceiling``: the envs split over one process per usable core that never communicate, their
  throughputs summed: what parallel stepping could reach with no coordination at all;
- ``serial`` / ``process`` / ``thread``: ``envfleet.make`` with that backend (default workers);
- ``gym-sync`` / ``gym-async``: Gymnasium's ``SyncVectorEnv`` and
  ``AsyncVectorEnv(shared_memory=True)`` (one process per env);
- ``sb3``: Stable-Baselines3's ``SubprocVecEnv`` (one process per env), if it is installed;
- ``envpool``: EnvPool's own implementation of the id, if it is installed and ships the id
  (its defaults may differ from Gymnasium's: Atari preprocessing, for one);
- ``pufferlib``: PufferLib's ``Multiprocessing`` vector env, if it is installed (one worker per
  core but one, for its main process: both busy-wait).

Modules: :mod:`~envfleet.benchmark.base` (timing, workload, results, load from elsewhere, the
runner interface), :mod:`~envfleet.benchmark.runners` (for-loop, ceiling, envfleet, Gymnasium),
:mod:`~envfleet.benchmark.peers` (SB3, EnvPool, PufferLib), :mod:`~envfleet.benchmark.registry`
(runners by name, availability), :mod:`~envfleet.benchmark.measure` (measuring, machine info,
sweeps) and :mod:`~envfleet.benchmark.report` (the report: table, notes, plot, JSON). Every
public name is importable from :mod:`envfleet.benchmark` itself, except those of
:mod:`~envfleet.benchmark.rollout` (rollouts with a policy in the loop, ``bench/rollout.py``),
whose openers take a rollout case and keep their own names there.
"""

from envfleet.benchmark.base import (
    CEILING,
    FAILED,
    LOOP,
    NOT_INSTALLED,
    OK,
    PARTIAL,
    UNAVAILABLE,
    UNSUPPORTED,
    LoopRunner,
    OtherLoad,
    Runner,
    RunResult,
    Timing,
    Workload,
)
from envfleet.benchmark.measure import PACKAGES, machine_info, measure, sweep
from envfleet.benchmark.peers import envpool_id, open_envpool, open_pufferlib, open_sb3
from envfleet.benchmark.registry import (
    ALIASES,
    RUNNERS,
    Availability,
    RunnerKind,
    availability,
    parse_runners,
)
from envfleet.benchmark.report import Report, report_notes, report_table, write_json, write_plot
from envfleet.benchmark.runners import (
    CEILING_TIMEOUT,
    CeilingRunner,
    open_ceiling,
    open_gym_async,
    open_gym_sync,
    open_loop,
)

__all__ = [
    "ALIASES",
    "CEILING",
    "CEILING_TIMEOUT",
    "FAILED",
    "LOOP",
    "NOT_INSTALLED",
    "OK",
    "PACKAGES",
    "PARTIAL",
    "RUNNERS",
    "UNAVAILABLE",
    "UNSUPPORTED",
    "Availability",
    "CeilingRunner",
    "LoopRunner",
    "OtherLoad",
    "Report",
    "RunResult",
    "Runner",
    "RunnerKind",
    "Timing",
    "Workload",
    "availability",
    "envpool_id",
    "machine_info",
    "measure",
    "open_ceiling",
    "open_envpool",
    "open_gym_async",
    "open_gym_sync",
    "open_loop",
    "open_pufferlib",
    "open_sb3",
    "parse_runners",
    "report_notes",
    "report_table",
    "sweep",
    "write_json",
    "write_plot",
]
