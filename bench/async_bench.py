"""Async pool: sync ``step`` against EnvPool-style ``send``/``recv`` side by side in one run.

Each layout (:data:`SCENARIOS`: envfleet, EnvPool, PufferLib) runs sync, then async with
``batch_size`` B (``/ own sync``: the async row over the sync row of its layout); target on
``heavytail`` (:class:`bench.envs.HeavyTailEnv` x 32): envfleet async >= 1.5x sync. A library
that is not installed shows as a failed row with the reason.

Usage::

    python bench/async_bench.py                  # everything: 3 x 3 s windows, about 7 minutes
    python bench/async_bench.py --quick          # smoke run: 1 x 0.5 s window
    python bench/async_bench.py --workloads heavytail --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from bench import common
from bench.common import Case
from bench.envs import HeavyTailEnv
from envfleet import benchmark
from envfleet.affinity import usable_cpus
from envfleet.benchmark import Report, Timing, Workload, open_envfleet

ASYNC_TARGET = 1.5
SYNC = " sync"


def layouts(prefix: str, batches: Sequence[int], opener: Callable[..., Any], **kw: Any) -> Any:
    """``prefix sync`` and ``prefix B=8`` (opened with ``batch_size=8``), ...; each forks unless
    it is envfleet's thread backend or EnvPool (threads in this process)."""
    forks = kw.get("backend") != "thread" and opener is not open_envpool
    return [Case(prefix + SYNC, functools.partial(opener, **kw), forks)] + [
        Case(f"{prefix} B={b}", functools.partial(opener, batch_size=b, **kw), forks)
        for b in batches
    ]


def sync_of(name: str) -> str:
    """The sync row of an async row's layout (``prefix B=8``: ``prefix sync``)."""
    return name.rsplit(" B=", 1)[0] + SYNC


def own_sync(report: Report, name: str, n: int) -> str:
    """``/ own sync``: an async row (``... B=8``) over the sync row of its layout."""
    ratio = report.ratio(name, n, sync_of(name))
    return "-" if " B=" not in name or ratio is None else f"{ratio:.2f}"


def open_envpool(workload: Workload, timing: Timing, **kw: Any) -> benchmark.Runner:
    """EnvPool with a thread per usable core (its pool's size otherwise)."""
    return benchmark.open_envpool(workload, timing, num_threads=len(usable_cpus()), **kw)


def process(workers: int = 0, threads: int = 0) -> dict[str, Any]:
    """envfleet's process backend, ``workers`` x ``threads`` where given (else its defaults)."""
    given = {"num_workers": workers, "threads_per_worker": threads}
    return {"backend": "process", **{key: value for key, value in given.items() if value}}


ENVFLEET, PUFFER = open_envfleet, benchmark.open_pufferlib
AS_ALE = dict(
    img_height=210,
    img_width=160,
    gray_scale=False,
    stack_num=1,
    repeat_action_probability=0.25,
    noop_max=1,
    use_fire_reset=False,
)
"""EnvPool's Pong-v5 configured like Gymnasium's ALE/Pong-v5 (EnvPool still max-pools frames)."""
SCENARIOS: dict[str, tuple[str, Any, int, list[Case]]] = {
    "heavytail": (
        "HeavyTailEnv x 32 (90% 0.2 ms, 10% 5 ms sleep)",
        HeavyTailEnv,
        32,
        [
            Case("ideal (32 x 1 env)", common.open_ideal),
            Case("for-loop", benchmark.open_loop),
            *layouts("envfleet thread", (16, 8), ENVFLEET, backend="thread"),
            *layouts("envfleet process defaults", (16, 8), ENVFLEET, **process()),
            *layouts("envfleet process 4w", (16, 8), ENVFLEET, **process(4)),
            *layouts("envfleet process 4w x8t", (16, 8), ENVFLEET, **process(4, 8)),
            *layouts("envfleet process 8w x4t", (16, 8), ENVFLEET, **process(8, 4)),
            *layouts("pufferlib mp 4w", (16, 8), PUFFER, num_workers=4),
        ],
    ),
    "cartpole": (
        "CartPole-v1 x 64",
        "CartPole-v1",
        64,
        [
            *layouts("envfleet process 2w", (32,), ENVFLEET, **process(2)),
            *layouts("envpool", (32,), open_envpool, task="CartPole-v1"),
            *layouts("pufferlib mp 2w", (32,), PUFFER, num_workers=2),
        ],
    ),
    "pong": (
        "Pong x 8 (envfleet/PufferLib: ALE/Pong-v5; EnvPool: its Pong-v5)",
        "ALE/Pong-v5",
        8,
        [
            *layouts("envfleet process 2w", (4,), ENVFLEET, **process(2)),
            *layouts("envfleet thread", (4,), ENVFLEET, backend="thread"),
            *layouts("envpool (84x84 grey x4)", (4,), open_envpool, task="Pong-v5"),
            *layouts("envpool (as ALE/Pong-v5)", (4,), open_envpool, task="Pong-v5", **AS_ALE),
            *layouts("pufferlib mp 2w", (4,), PUFFER, num_workers=2),
        ],
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__ or "", common.RESULTS / "async_bench.json")
    common.add_choice(parser, "--workloads", list(SCENARIOS))
    args = parser.parse_args(argv)
    timing = common.timing_from(args)
    # EnvPool's spaces: "Box low's precision lowered by casting to float32".
    warnings.filterwarnings("ignore", message=".*precision lowered.*")
    peers = ("envpool", "pufferlib-core", "pufferlib")
    with common.script_run(args.json, peers, width=140) as (console, report):
        report["workloads"] = {}
        for name in args.workloads:
            title, env, n, cases = SCENARIOS[name]
            columns = [("/ own sync", own_sync)]
            measured = common.measure_table(
                console, title, cases, Workload.of(env, n), timing, columns=columns
            )
            checks = [
                common.target(console, f"{c.name} / sync", ratio, ASYNC_TARGET, end="")
                for c in cases
                if name == "heavytail" and c.name.startswith("envfleet") and " B=" in c.name
                for ratio in [measured.ratio(c.name, n, sync_of(c.name))]
            ]
            report["workloads"][name] = {**common.rows(measured), "async_targets": checks}
    return 0


if __name__ == "__main__":
    sys.exit(main())
