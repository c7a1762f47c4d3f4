"""What ``envfleet`` tells a newcomer, and when: the first line before anything is built, the
stage lines of piped output, the progress bar's ETA, ``--help`` without the ``cli`` extra,
tables that never cut a number, and what the ``--stats`` and ``tune --policy`` tables say."""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import pytest
from rich.console import Console

import envfleet
from envfleet import _run_args as run_args
from envfleet import _starting as early_line
from envfleet.__main__ import COMMANDS
from envfleet._starting import early_starting_line
from envfleet.cli import build_parser, main
from envfleet.cli.common import StageLog, clock
from envfleet.cli.run import _check_run_args, _starting
from envfleet.cli.runner import RandomPolicy, RunLoop, progress_text, remaining

ROOT = Path(__file__).resolve().parent.parent
ENV = "CartPole-v1"


def envfleet_subprocess(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "envfleet", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=timeout,
        check=False,
    )


def read_line(stream: io.TextIOBase, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return stream.readline()


# -- the first line, before anything is built ----------------------------------------------------


def test_run_says_what_it_starts_before_the_pool_is_built(tmp_path: Path) -> None:
    """Gate-v0's constructor waits for a file: the ``starting`` line must be out while it
    waits (make() builds one env to learn the spaces before any worker starts), and piped
    output has a line per stage."""
    gate = tmp_path / "gate"
    command = [sys.executable, "-m", "envfleet", "run", "Gate-v0", "--import", "tests.cli_envs"]
    process = subprocess.Popen(
        [*command, "--num-envs", "2", "--num-workers", "2", "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ENVFLEET_TEST_GATE": str(gate)},
    )
    try:
        assert process.stderr is not None
        first = read_line(process.stderr, timeout=60)
        assert first == (
            "envfleet: starting Gate-v0: 2 envs on 2 worker processes; then 50 steps\n"
        )
        assert process.poll() is None  # still held at the gate: nothing built yet
        gate.touch()
        out, rest = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, rest
    lines = rest.splitlines()
    assert lines[0].startswith("envfleet: started 2 worker processes in ")
    assert lines[0].endswith(" s; running")
    assert lines[1].startswith("envfleet: done: 50 steps in 0:")
    assert len(lines) == 2, rest
    assert "steps/s" in out


def test_bad_input_is_one_line_with_no_starting_line_before_it(tmp_path: Path) -> None:
    for argv in (
        ["run", "CartPol-v1"],
        ["run", ENV, "--out", str(tmp_path / "no" / "such.npz")],
        ["run", ENV, "--batch-size", "9"],
    ):
        result = envfleet_subprocess(*argv)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith("envfleet: error: ")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--backend", "serial", "--num-envs", "3"], "3 envs in this process (serial backend)"),
        (["--backend", "thread", "--num-envs", "4"], "4 envs on 4 threads"),
        (["--num-envs", "1"], "1 env on 1 worker process"),
        (["--num-workers", "2", "--threads-per-worker", "4"], "8 envs on 2 worker processes x 4"),
        (
            ["--backend", "ray", "--num-workers", "2"],
            "8 envs on 2 Ray actors, after starting a local Ray (several seconds)",
        ),
        (
            ["--backend", "ray", "--num-workers", "1", "--address", "auto"],
            "8 envs on 1 Ray actor, joining the Ray at auto",
        ),
    ],
)
def test_the_starting_line_names_the_workers_and_the_ray_to_start(
    argv: list[str], line: str
) -> None:
    args = build_parser().parse_args(["run", ENV, *argv, "--seconds", "2"])
    text = _starting(args)
    assert text.startswith(f"starting {ENV}: {line}")
    assert text.endswith("; then 2 s")


# -- progress: ETA and steps/s, on a terminal and piped ------------------------------------------


def test_the_eta_is_the_time_left_at_the_rate_so_far() -> None:
    assert remaining(0, 0.0, 1000, None) is None
    assert remaining(250, 2.0, 1000, None) == pytest.approx(6.0)
    assert remaining(1200, 2.0, 1000, None) == 0.0
    assert remaining(10, 2.5, None, 10.0) == pytest.approx(7.5)
    assert clock(6.0) == "0:06" and clock(3725) == "1:02:05"
    assert progress_text(250, 2.0, 1000, None) == "250/1,000 steps · 125 steps/s · ETA 0:06"
    assert progress_text(10, 2.5, None, 10.0) == "10 steps · 4 steps/s · ETA 0:08"


def test_piped_runs_print_a_progress_line_every_interval() -> None:
    """Where there is no live bar, the run loop prints a plain progress line at most every
    ``interval`` seconds (every batch with 0 here; the real one is 10 s)."""
    buffer = io.StringIO()
    stages = StageLog(Console(file=buffer, width=200), interval=0.0)
    with envfleet.make(ENV, 2, backend="serial", seed=0) as pool:
        pool.action_space.seed(0)
        loop = RunLoop(
            pool,
            RandomPolicy(pool.action_space),
            "random",
            steps=20,
            seconds=None,
            recorder=None,
            display=None,
            stages=stages,
        )
        loop.run()
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("envfleet: 2/20 steps · ")
    assert lines[-1].startswith("envfleet: 20/20 steps · ") and lines[-1].endswith("ETA 0:00")

    quiet = io.StringIO()
    stages = StageLog(Console(file=quiet), interval=3600.0)
    stages.progress(lambda: "never")
    assert quiet.getvalue() == ""


def test_a_progress_line_comes_an_interval_after_the_last_stage_line() -> None:
    """A start-up longer than the interval (a Ray to start) does not bring a progress line at
    the first step: the interval counts from the ``started`` line."""
    buffer = io.StringIO()
    stages = StageLog(Console(file=buffer, width=200), interval=60.0)
    stages.progress(lambda: "too soon")  # the interval counts from the log's start too
    stages._next_progress = time.perf_counter()  # as after a start-up longer than the interval
    stages.line("started")
    stages.progress(lambda: "too soon")
    assert buffer.getvalue() == "envfleet: started\n"


# -- --help without the cli extra ----------------------------------------------------------------

NO_RICH = (
    "import importlib.util, runpy, sys\n"
    "find = importlib.util.find_spec\n"
    "importlib.util.find_spec = lambda name, *a: None if name == 'rich' else find(name, *a)\n"
    "sys.modules['rich'] = None\n"
    "from envfleet.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def without_rich(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_RICH, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["run", "--help"]])
def test_help_works_without_the_cli_extra_and_says_what_to_install(argv: list[str]) -> None:
    result = without_rich(*argv)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("usage: envfleet")
    for name, text in COMMANDS.items():
        assert f"  {name}" in result.stdout and text in result.stdout
    assert "missing: rich" in result.stdout
    assert "pip install 'envfleet[cli]'" in result.stdout


def test_without_the_cli_extra_a_command_is_one_line_and_version_answers() -> None:
    result = without_rich("run", ENV)
    assert result.returncode == 2
    assert result.stderr == (
        "envfleet: error: the command line needs rich: pip install 'envfleet[cli]'\n"
    )
    result = without_rich("--version")
    assert (result.returncode, result.stdout) == (0, f"envfleet {envfleet.__version__}\n")


def test_the_help_without_the_extra_lists_the_parsers_commands() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}  # type: ignore[attr-defined]
    assert helps == COMMANDS


# -- tables: no number cut, captions that explain ------------------------------------------------


@pytest.mark.parametrize("columns", ["30", "60"])
def test_narrow_or_piped_output_never_cuts_a_number(columns: str) -> None:
    """Rich fits tables to the console (80 columns when piped, COLUMNS if set) by shortening
    cells with an ellipsis; the command prints them whole instead."""
    result = envfleet_subprocess(
        "run", ENV, "--backend", "serial", "--num-envs", "4", "--steps", "12345", "--stats",
        env={"COLUMNS": columns},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    assert "12,348" in result.stdout  # the steps, whole (a multiple of 4 envs)
    assert "mean return" in result.stdout


def test_stats_of_a_synchronous_run_say_why_the_workers_look_alike(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["run", ENV, "--num-envs", "4", "--num-workers", "2", "--steps", "400",
                   "--stats", "-q"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert "pool stats" in out
    assert "synchronous steps: every worker gets each step at once" in " ".join(out.split())

    status = main(["run", ENV, "--num-envs", "4", "--num-workers", "2", "--batch-size", "2",
                   "--steps", "400", "--stats", "-q"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "pool stats" in out
    assert "synchronous steps" not in out  # async: per-worker figures, nothing to explain


def test_tune_titles_its_table_with_the_policy_that_chose_the_actions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["tune", ENV, "--num-envs", "2", "--budget", "1", "-q",
                   "--policy", "tests.cli_policies:always_zero"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "layouts, actions by tests.cli_policies:always_zero" in out
    assert "random actions" not in out
    status = main(["tune", ENV, "--num-envs", "2", "--budget", "1", "-q"])
    assert status == 0
    assert "layouts, random actions" in capsys.readouterr().out


def test_json_output_has_no_stage_lines() -> None:
    result = envfleet_subprocess("run", ENV, "--backend", "serial", "--steps", "50", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["steps"] >= 50
    assert result.stderr == ""


def test_the_starting_line_comes_before_the_policy_is_imported() -> None:
    """A policy module that takes long to import (torch) does not hold the first line back."""
    result = envfleet_subprocess(
        "run", ENV, "--backend", "serial", "--steps", "10", "--policy", "no_such_policy_mod:act"
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"envfleet: starting {ENV}")
    assert lines[1].startswith("envfleet: error: --policy no_such_policy_mod:act: no module")


# -- the first line, before the heavy imports ----------------------------------------------------


def test_the_starting_line_comes_before_gymnasium_and_numpy_are_imported() -> None:
    """``-X importtime`` writes a line to stderr as each import ends: the ``starting`` line
    must come before the first of Gymnasium's or numpy's (the imports that took most of a
    second before anything was said), and only once."""
    result = envfleet_subprocess(
        "run", ENV, "--backend", "serial", "--steps", "50", env={"PYTHONPROFILEIMPORTTIME": "1"}
    )
    assert result.returncode == 0, result.stderr
    # An import-time line and a stage line may share a line (neither waits for the other's
    # newline): split before each stage line.
    lines = result.stderr.replace("envfleet: ", "\nenvfleet: ").splitlines()
    starting = [i for i, line in enumerate(lines) if line.startswith("envfleet: starting ")]
    assert len(starting) == 1, result.stderr
    heavy = [
        i
        for i, line in enumerate(lines)
        if line.startswith("import time:")
        and line.rsplit("|", 1)[-1].strip().split(".")[0] in ("gymnasium", "numpy")
    ]
    assert heavy, "no import-time lines for gymnasium and numpy"
    assert starting[0] < heavy[0]
    assert lines[starting[0]] == (
        f"envfleet: starting {ENV}: 8 envs in this process (serial backend); then 50 steps"
    )


def test_import_envfleet_imports_neither_gymnasium_nor_numpy_until_a_name_is_used() -> None:
    code = (
        "import sys, envfleet\n"
        "print(sorted(m for m in ('gymnasium', 'numpy') if m in sys.modules))\n"
        "envfleet.make\n"
        "print(sorted(m for m in ('gymnasium', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=True,
    )
    assert result.stdout.splitlines() == ["[]", "['gymnasium', 'numpy']"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "serial", "--num-envs", "3"],
        ["--num-workers", "2", "--threads-per-worker", "4", "--steps", "7"],
        ["--backend", "ray", "--address", "auto", "--seconds", "2"],
        ["--out", "rollout.npz"],
    ],
)
def test_the_early_starting_line_is_the_commands_own(argv: list[str]) -> None:
    args = build_parser().parse_args(["run", ENV, *argv])
    _check_run_args(args)
    assert early_starting_line(["run", ENV, *argv]) == _starting(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "CartPol-v1"],  # unknown: the command line says so, with its hint
        ["run", "ALE/Pongg-v5"],  # no such ROM: the command line says so, with its hint
        ["run", "ALE/Combat-v5"],  # a ROM ale_py registers no v5 id for
        ["run", "ALE/Pong-v4"],  # registered by a package: the command line looks it up
        ["run", "tests.cli_envs:Gate-v0"],
        ["run", "Gate-v0", "--import", "tests.cli_envs"],
        ["run", ENV, "--quiet"],
        ["run", ENV, "--json"],
        ["run", ENV, "--batch-size", "9"],
        ["run", ENV, "--num-envs", "0"],
        ["run", ENV, "--out", "no/such/folder/x.npz"],
        ["run", ENV, "--no-such-option"],
        ["run", "--help"],
        ["bench", ENV],
        [],
    ],
)
def test_the_early_starting_line_leaves_what_it_cannot_tell_to_the_command_line(
    argv: list[str],
) -> None:
    assert early_starting_line(argv) is None


def test_what_the_early_line_knows_of_the_library_is_the_librarys() -> None:
    from envfleet.affinity import usable_cpus
    from envfleet.backends.contract.registry import kind_of
    from envfleet.pool import DEFAULT_MAX_RESTARTS

    assert tuple(backend.value for backend in envfleet.Backend) == run_args.BACKENDS
    for backend in envfleet.Backend:
        can = kind_of(backend).capabilities
        assert (backend.value in early_line._ONE_WORKER) is can.one_worker
        assert (backend.value in early_line._WORKER_PER_ENV) is can.worker_per_env
    assert run_args.DEFAULT_MAX_RESTARTS == DEFAULT_MAX_RESTARTS
    assert tuple(early_line._usable_cpus()) == usable_cpus()
    ids = early_line.gymnasium_builtin_ids()
    assert ENV in ids
    assert ids <= set(gymnasium.registry)


def test_the_early_line_knows_the_ale_ids_ale_py_registers() -> None:
    """What the early path takes for an ALE id without importing ale_py is exactly the v5 ids
    ale_py registers (``make run`` steps ``ALE/Pong-v5``)."""
    ale_py = pytest.importorskip("ale_py")
    gymnasium.register_envs(ale_py)
    v5 = {env_id for env_id in gymnasium.registry if re.fullmatch(r"ALE/\w+-v5", env_id)}
    assert "ALE/Pong-v5" in v5
    assert all(early_line.is_installed_ale_id(env_id) for env_id in v5)
    names = {env_id[len("ALE/") : -len("-v5")] for env_id in v5}
    for rom in (Path(ale_py.__file__).parent / "roms").glob("*.bin"):
        name = rom.stem.title().replace("_", "")  # as ale_py names its ids
        assert early_line.is_installed_ale_id(f"ALE/{name}-v5") is (name in names), rom.stem
    args = build_parser().parse_args(["run", "ALE/Pong-v5", "--num-envs", "8"])
    _check_run_args(args)
    assert early_starting_line(["run", "ALE/Pong-v5", "--num-envs", "8"]) == _starting(args)
