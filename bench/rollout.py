"""Rollout collection with a PyTorch policy in the loop, every contender side by side (a thin
caller of :mod:`envfleet.benchmark.rollout`).

Workloads, each driven by one policy on CPU (``torch.set_num_threads`` chosen and printed):

- ``cartpole``: CartPole-v1 x 64, an MLP (2 x 64) sampling actions;
- ``pong``: Pong x 16 with Gymnasium's standard preprocessing (``AtariPreprocessing`` 84x84
  grey, frame skip 4, ``FrameStackObservation`` 4) and the Nature-DQN CNN; EnvPool configured
  the same way;
- ``heavy``: :class:`bench.async_envs.HeavyTailEnv` (90% of steps 0.2 ms, 10% 5 ms) x 32, MLP;
  envfleet on 8 workers of 4 threads (``threads_per_worker=4``).

Contenders: envfleet sync and async (double-buffered, ``batch_size = num_envs / 2``; also with
a worker fewer than cores, leaving one for the policy), Gymnasium
``AsyncVectorEnv``, SB3 ``SubprocVecEnv``, EnvPool sync and async (Pong and CartPole) where it
is installed. Prints, per workload, env-steps/s including inference, the ratio to envfleet sync,
and the shares of wall time the policy waited for the envs and the envs waited for the policy;
then the ratios the targets are about. Writes everything, with machine info, to JSON.

Usage::

    python bench/rollout.py                                # all three, a few minutes
    python bench/rollout.py --workloads pong --seconds 5 --repeats 5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import importlib.util
import json
import traceback
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console

from bench.async_envs import HeavyTailEnv
from bench.rollout_envs import ENVPOOL_PONG, TorchPolicy, make_pong, mlp, nature_cnn
from envfleet import benchmark
from envfleet.benchmark import rollout

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "rollout.json"
TARGETS = {  # (numerator, denominator) -> target ratio, per workload
    "pong": {
        ("envfleet-async", "envfleet-sync"): 1.5,
        ("best envfleet", "gym-async"): 1.5,
        ("best envfleet", "sb3"): 1.5,
        ("best envfleet", "envpool"): 1.0,
    },
    "heavy": {
        ("envfleet-async", "envfleet-sync"): 1.5,
        ("best envfleet", "gym-async"): 1.5,
        ("best envfleet", "sb3"): 1.5,
    },
    "cartpole": {("best envfleet", "gym-async"): 1.5, ("best envfleet", "sb3"): 1.5},
}


def cartpole(seed: int) -> rollout.RolloutWorkload:
    torch.manual_seed(seed)
    return rollout.RolloutWorkload(
        "cartpole",
        benchmark.Workload.of("CartPole-v1", 64),
        TorchPolicy(mlp(4, 2), seed),
        envpool_task="CartPole-v1",
    )


def pong(seed: int) -> rollout.RolloutWorkload:
    torch.manual_seed(seed)
    return rollout.RolloutWorkload(
        "pong",
        benchmark.Workload.of(make_pong, 16),
        TorchPolicy(nature_cnn(6), seed),
        envpool_task="Pong-v5",
        envpool_kwargs=ENVPOOL_PONG,
    )


def heavy(seed: int) -> rollout.RolloutWorkload:
    torch.manual_seed(seed)
    return rollout.RolloutWorkload(
        "heavy",
        benchmark.Workload.of(HeavyTailEnv, 32),
        TorchPolicy(mlp(4, 2), seed),
        # The env mostly sleeps: 8 workers of 4 threads, so that a batch is not held back by
        # the slowest of many envs (a worker replies when all the envs it was sent are done).
        num_workers=8,
        envfleet_kwargs={"threads_per_worker": 4},
    )


WORKLOADS: dict[str, Callable[[int], rollout.RolloutWorkload]] = {
    "cartpole": cartpole,
    "pong": pong,
    "heavy": heavy,
}


def _names(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown}: choose from {','.join(choices)}")
        return names

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=_names(list(WORKLOADS)), default=list(WORKLOADS))
    parser.add_argument(
        "--runners",
        type=_names(list(rollout.ROLLOUT_RUNNERS)),
        default=list(rollout.ROLLOUT_RUNNERS),
        help=f"comma-separated, from {','.join(rollout.ROLLOUT_RUNNERS)}",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per contender")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    return parser.parse_args(argv)


def verdicts(name: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of workload ``name`` with the measured ratio (``None``: not measured)."""
    rates = {n: r.median for n, r in results.items() if isinstance(r, benchmark.RunResult)}
    ours = [rates[n] for n in rates if n.startswith("envfleet")]
    if ours:
        rates["best envfleet"] = max(ours)
    out = []
    for (a, b), target in TARGETS.get(name, {}).items():
        ratio = rates[a] / rates[b] if a in rates and rates.get(b) else None
        out.append({"ratio": f"{a} / {b}", "value": ratio, "target": target})
    return out


def run_workload(
    case: rollout.RolloutWorkload, runners: list[str], timing: benchmark.Timing, console: Console
) -> dict[str, Any]:
    skipped = {}
    names = []
    for name in runners:
        reason = rollout.ROLLOUT_RUNNERS[name].unavailable(case)
        if reason is None:
            names.append(name)
        else:
            skipped[name] = reason
    skipped["pufferlib"] = (
        "not installed" if importlib.util.find_spec("pufferlib") is None else "no rollout runner"
    )

    def report_failure(name: str, exc: BaseException) -> None:
        console.print(f"[red]{case.name}: {name} failed[/red]")
        console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)

    with console.status(f"{case.name} ...") as status:
        results = benchmark.measure(
            names,
            case.workload,
            timing,
            on_error=report_failure,
            progress=status.update,
            openers=rollout.rollout_openers(case, names),
        )
    console.print(rollout.rollout_table(case, results, timing, skipped))
    checks = verdicts(case.name, results)
    for check in checks:
        value = check["value"]
        if value is None:
            console.print(f"  {check['ratio']}: not measured (target >= {check['target']})")
        else:
            mark = "[green]met[/green]" if value >= check["target"] else "[red]missed[/red]"
            console.print(f"  {check['ratio']} = {value:.2f} (target >= {check['target']}) {mark}")
    console.print()
    return {
        "env": case.workload.label,
        "num_envs": case.workload.num_envs,
        "results": {
            n: (r if isinstance(r, str) else {"steps_per_s": r.median, "windows": r.throughputs,
                                              "setup_s": r.setup_s, "other_load_cores":
                                              r.other_load, "info": r.info})
            for n, r in results.items()
        },
        "skipped": skipped,
        "targets": checks,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    timing = benchmark.Timing.scaled(args.seconds, args.repeats, args.seed)
    console = Console(width=max(Console().width, 120))
    machine = benchmark.machine_info(["torch"])
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, "
        f"Python {machine['python']}, torch threads {torch.get_num_threads()}, "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    report: dict[str, Any] = {
        "machine": machine,
        "timing": timing.as_dict(),
        "torch_threads": torch.get_num_threads(),
        "workloads": {},
    }
    for name in args.workloads:
        case = WORKLOADS[name](args.seed)
        report["workloads"][name] = run_workload(case, args.runners, timing, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
