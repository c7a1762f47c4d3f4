"""What the ``bench/`` scripts share: their rows (:class:`Case`) measured and tabulated by
:mod:`envfleet.benchmark` (:func:`measure_table`), the options every script takes, a console
whose libraries' output goes to a log, timed calls and a fake Ray cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from envfleet import benchmark
from envfleet.cli.common import OutputCapture

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    """One row of a script's table: a name and an opener with a registered runner's signature."""

    name: str
    open: Callable[[benchmark.Workload, benchmark.Timing], benchmark.Runner]


@contextlib.contextmanager
def session(json_path: Path, width: int = 120) -> Iterator[Console]:
    """A console on this process's stdout, while what is written to file descriptors 1 and 2
    (ale-py's banner, Ray's warnings, worker processes) goes to ``json_path`` with ``.log``."""
    stdout = os.fdopen(os.dup(1), "w", buffering=1)
    console = Console(file=stdout, width=max(Console().width, width))
    with OutputCapture() as captured:
        yield console
    if captured.text.strip():
        log = json_path.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(captured.text)
        lines = len(captured.text.splitlines())
        console.print(f"{lines} lines printed by libraries and envs: {log}", markup=False)


@contextlib.contextmanager
def progress(console: Console, title: str) -> Iterator[dict[str, Callable[[str], object]]]:
    """The engine's progress hooks: a live line on a terminal, else a line per runner."""
    if console.is_terminal:
        with console.status(title) as status:
            yield {"progress": lambda text: status.update(f"{title}: {text}")}
    else:
        yield {"on_stage": lambda text: console.print(text, markup=False, highlight=False)}


def measure_table(
    console: Console,
    title: str,
    cases: Sequence[Case | str],
    workload: benchmark.Workload,
    timing: benchmark.Timing,
    reference: str | None = None,
    columns: Sequence[benchmark.Column] = (),
) -> benchmark.Report:
    """Measure ``cases`` (or the registry's runners, by name) side by side on ``workload``
    (:func:`envfleet.benchmark.sweep`), print ``title`` and the engine's table (ratios to row
    ``reference``, and ``columns``) with its notes; a failed row prints its traceback."""

    def failed(name: str, _n: int, exc: BaseException) -> None:
        console.print(f"[red]{name} failed[/red]: {type(exc).__name__}: {str(exc)[:300]}")
        if not isinstance(exc, ImportError):
            text = "".join(traceback.format_exception(exc))
            console.print(text[-2000:], markup=False, highlight=False)

    own = {c.name: c for c in cases if isinstance(c, Case)}
    names = [c if isinstance(c, str) else c.name for c in cases]
    with progress(console, f"{title}: {len(cases)} runners") as hooks:
        report = benchmark.sweep(
            workload.spec,
            [workload.num_envs],
            names,
            timing,
            on_error=failed,
            openers={name: c.open for name, c in own.items()},
            **hooks,
        )
    console.print(f"[bold]{title}[/bold]")
    console.print(benchmark.report_table(report, reference or "ceiling", columns))
    for note in benchmark.report_notes(report):
        console.print(f"[yellow]{note}[/yellow]")
    return report


def rows(report: benchmark.Report) -> dict[str, Any]:
    """A one-count report's JSON, less the machine (written once per script)."""
    return {key: value for key, value in report.as_dict().items() if key != "machine"}


def target(
    console: Console,
    label: str,
    value: float | None,
    bound: float,
    *,
    most: bool = False,
    end: str = "\n",
) -> dict[str, Any]:
    """Print ``label = value (target >= bound) met/missed`` (``most``: ``<= bound``); its JSON
    (``met`` is ``None`` when ``value`` was not measured)."""
    met = None if value is None else value <= bound if most else value >= bound
    mark = {None: "", True: " [green]met[/green]", False: " [red]missed[/red]"}[met]
    shown, sign = "-" if value is None else f"{value:.2f}", "<=" if most else ">="
    console.print(f"[bold]{label} = {shown}[/bold] (target {sign} {bound:g}){mark}{end}")
    return {"ratio": label, "value": value, "maximum" if most else "minimum": bound, "met": met}


# -- options, machine, JSON --------------------------------------------------------------------


def script_parser(
    doc: str, default_json: Path, rounds: int | None = None
) -> argparse.ArgumentParser:
    """The options every benchmark script takes: seed, JSON, quick, and either windows of runners
    (``--seconds``, ``--repeats``, ``--warmup``: :func:`timing_from`) or, given ``rounds``,
    paired rounds (``--rounds``, ``--seconds`` a window: :func:`paired_args`)."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=default_json, help="where to write results")
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds, help="paired rounds")
        parser.add_argument("--seconds", type=float, default=1.0, help="a window")
        parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 0.2 s")
        return parser
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    parser.add_argument("--repeats", type=int, default=None, help="windows per runner (default 3)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up s (default 1)")
    parser.add_argument("--quick", action="store_true", help="1 window of 0.5 s per runner")
    return parser


def paired_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Paired rounds' options parsed (``--quick``: 2 rounds of 0.2 s)."""
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 0.2
    return args


def timing_from(args: argparse.Namespace, full: tuple[float, int] = (3.0, 3)) -> benchmark.Timing:
    """The :class:`Timing` of :func:`script_parser`'s options (``full``: the seconds and
    repeats without ``--quick``)."""
    seconds, repeats, warmup, rewarm = (0.5, 1, 0.3, 0.1) if args.quick else (*full, 1.0, 0.2)
    return benchmark.Timing(
        seconds=args.seconds if args.seconds is not None else seconds,
        repeats=args.repeats if args.repeats is not None else repeats,
        warmup=args.warmup if args.warmup is not None else warmup,
        rewarm=rewarm,
        seed=args.seed,
    )


def add_choice(
    parser: argparse.ArgumentParser,
    flag: str,
    choices: Sequence[str],
    default: Sequence[str] | None = None,
) -> None:
    """A ``flag`` option taking a comma-separated subset of ``choices`` (``default``: all), as a
    list, checked."""

    def chosen(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or 'none'}: choose from {','.join(choices)}"
            )
        return names

    default = list(choices if default is None else default)
    shown = "" if len(default) == len(choices) else f" (default: {','.join(default)})"
    parser.add_argument(
        flag, type=chosen, default=default, help=f"comma-separated, from {','.join(choices)}{shown}"
    )


@contextlib.contextmanager
def script_run(
    json_path: Path, packages: Sequence[str] = (), width: int = 120
) -> Iterator[tuple[Console, dict[str, Any]]]:
    """A script's run: its :func:`session`, the machine printed (:func:`print_machine`), and
    the JSON document it fills, written to ``json_path`` at the end."""
    with session(json_path, width) as console:
        document = {"machine": print_machine(console, packages)}
        yield console, document
    save_json(json_path, document, console)


def print_machine(console: Console, packages: Sequence[str] = ()) -> dict[str, Any]:
    """Print a one-line summary of :func:`~envfleet.benchmark.machine_info`; return it."""
    machine = benchmark.machine_info(packages)
    load = machine["load_average_at_start"]
    wakes = benchmark.describe_wakes(machine["wake_round_trip_us"])
    console.print(
        f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, Python "
        f"{machine['python']}, load average {f'{load[0]:.2f}' if load else '-'}"
        + (f", a wake-up's round trip {wakes}" if wakes else "")
        + "; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    )
    return machine


def save_json(path: Path, report: dict[str, Any], console: Console | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if console is not None:
        console.print(f"results written to {path}")


# -- what the scripts that time by hand share ----------------------------------------------------


def timed(call: Callable[[], object], rounds: int) -> list[float]:
    """Seconds ``rounds`` calls of ``call`` take: wall, this process's CPU and this thread's."""
    clocks = (time.perf_counter, time.process_time, time.thread_time)
    start = [clock() for clock in clocks]
    for _ in range(rounds):
        call()
    return [clock() - s for clock, s in zip(clocks, start, strict=True)]


@contextlib.contextmanager
def fake_cluster(
    nodes: int,
    resources: Sequence[dict[str, float]] = (),
    runtime_env: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """A Ray cluster of ``nodes`` nodes on this machine (one CPU each; the ``k``-th after the
    head with ``resources[k]``), connected with ``runtime_env``; ``None`` and no Ray if
    ``nodes`` is 0."""
    if not nodes:
        yield None
        return
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for k in range(nodes - 1):
            cluster.add_node(**node, resources=resources[k] if k < len(resources) else {})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env or {})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
