"""The README, the documentation site and the install: every Python block of the README and of
``docs/`` runs as written, every ``envfleet`` command they show parses (and the ones naming the
modules of ``examples/`` run), the site builds with ``mkdocs build --strict``, and the extras the
pages name match ``pyproject.toml``.

The blocks run one after another in one subprocess (one start of Python), each in a fresh
namespace, so that a new block is tested without any change here; those that start a Ray of
their own run likewise in a second subprocess, beside the first. A block shown twice (the README
repeats some of the docs' examples) runs once. A block that cannot run in a test says so on its
first line, with the reason: ``# readme-test: skip (why)``; use it sparingly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from envfleet.cli import build_parser
from envfleet.spec import EnvSpec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PAGES = {
    "README.md": README,
    **{str(path.relative_to(ROOT)): path.read_text() for path in sorted(DOCS.rglob("*.md"))},
}
SKIP = re.compile(r"^# readme-test: skip \((?P<reason>[^)]+)\)")

RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
for name, source in blocks:
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})  # as a script runs
    except BaseException:
        print(json.dumps({"block": name, "error": traceback.format_exc()}), flush=True)
    else:
        print(json.dumps({"block": name, "error": None}), flush=True)
try:
    import ray
    if ray.is_initialized():
        ray.shutdown()
except ImportError:
    pass
"""


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def all_blocks(language: str) -> list[tuple[str, str]]:
    """``(where, source)`` of every ``language`` block of the README and the docs, in order."""
    return [
        (f"{page} block {index}", source)
        for page, text in PAGES.items()
        for index, source in enumerate(blocks(language, text), start=1)
    ]


def commands(block: str) -> list[str]:
    """The ``envfleet`` command lines of a shell block, without their comments."""
    return [
        line.split("#")[0].strip()
        for line in block.splitlines()
        if line.startswith(("envfleet ", "python -m envfleet "))
    ]


def argv_of(command: str) -> list[str]:
    argv = shlex.split(command)
    return argv[3:] if argv[0] == "python" else argv[1:]


def test_the_pages_have_python_blocks_and_skip_only_with_a_reason() -> None:
    assert len(blocks("python")) >= 3
    assert {"docs/index.md", "docs/faq.md", "docs/migrating.md"} <= set(PAGES)
    python = all_blocks("python")
    assert len(python) >= 12
    for where, source in python:
        first = source.splitlines()[0] if source.strip() else ""
        if first.startswith("# readme-test"):
            assert SKIP.match(first), f"{where}: a skip marker needs a reason: {first!r}"


def test_the_readme_fits_on_a_screen_or_two_and_links_into_the_docs() -> None:
    assert len(README.splitlines()) <= 200
    assert "make run" in README and "make test" in README
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link


def starts_ray(source: str) -> bool:
    """Whether a block runs a pool on Ray (which then starts a Ray of its own)."""
    return 'backend="ray"' in source


def run_blocks(blocks: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], str, int]:
    """Run ``blocks`` one after another in one subprocess (:data:`RUNNER`): its reports, the
    end of its stderr and its exit status."""
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=290,
        check=False,
    )
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return reports, result.stderr[-3000:], result.returncode


@pytest.mark.timeout(300)
def test_every_python_block_runs() -> None:
    """Every block runs as written. The blocks that start a Ray of their own run in a second
    subprocess, at the same time as the others: Ray's start and shutdown are mostly waiting
    (seconds), and the other blocks never touch Ray."""
    to_run: list[tuple[str, str]] = []
    seen: set[str] = set()
    for where, source in all_blocks("python"):
        if SKIP.match(source) or source in seen:
            continue
        seen.add(source)
        to_run.append((where, source))
    plain = [block for block in to_run if not starts_ray(block[1])]
    groups = [group for group in (plain, [b for b in to_run if b not in plain]) if group]
    with ThreadPoolExecutor(len(groups)) as threads:
        runs = list(threads.map(run_blocks, groups))
    for group, (reports, stderr, returncode) in zip(groups, runs, strict=True):
        assert [r["block"] for r in reports] == [where for where, _ in group], stderr
        failures = [f"{r['block']}:\n{r['error']}" for r in reports if r["error"] is not None]
        assert not failures, "\n".join(failures)
        assert returncode == 0, stderr


def test_every_envfleet_command_in_the_pages_parses() -> None:
    shown = [command for _, block in all_blocks("sh") for command in commands(block)]
    assert len(shown) >= 12
    parser = build_parser()
    for command in shown:
        argv = argv_of(command)
        if "--help" in argv:
            continue
        args, unknown = parser.parse_known_args(argv)
        assert not unknown, (command, unknown)
        assert args.handler is not None
        if ":" not in args.env and not args.imports:  # runs as written: the id is registered
            EnvSpec.from_user(args.env)


def example_commands() -> list[str]:
    """The commands the docs show to run from ``examples/`` (a block that starts there)."""
    return [
        command
        for _, block in all_blocks("sh")
        if block.startswith("cd examples\n")
        for command in commands(block)
    ]


@pytest.mark.parametrize("command", example_commands())
def test_the_commands_run_from_examples_run(command: str) -> None:
    """Copy-paste true: the modules they name (``mysim``, ``mypkg.policies``) are there, and each
    command runs as shown, made short (``--steps 300`` for ``run``, ``--budget 1`` for ``tune``)."""
    argv = argv_of(command)
    if argv[0] == "run" and "--steps" not in argv and "--seconds" not in argv:
        argv += ["--steps", "300"]
    if argv[0] == "tune":
        argv += ["--budget", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "envfleet", *argv, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT / "examples",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    policy = argv[argv.index("--policy") + 1] if "--policy" in argv else "random"
    assert summary["policy"] == policy
    if argv[0] == "run":
        assert summary["steps"] >= 300
        assert summary["env"] == argv[1]
    else:
        assert any(layout["steps_per_second"] for layout in summary["layouts"])


def test_the_examples_the_cli_page_names_exist() -> None:
    assert len(example_commands()) >= 5
    assert (ROOT / "examples" / "mysim.py").is_file()
    assert (ROOT / "examples" / "mypkg" / "policies.py").is_file()


@pytest.mark.timeout(120)
def test_the_documentation_site_builds_strict(tmp_path: Path) -> None:
    """``make docs``: a broken link, a missing page or an unreadable docstring fails the build;
    the API reference is read from the docstrings."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    command = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    result = subprocess.run(
        [*command, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    make = (tmp_path / "site" / "api" / "make" / "index.html").read_text()
    assert "Run <code>num_envs</code> environments in parallel" in make
    bench = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert 'src="../assets/bench-cartpole/bench.png"' in bench
    assert (tmp_path / "site" / "assets" / "bench-cartpole" / "bench.png").is_file()


def test_the_install_matches_what_the_pages_say() -> None:
    """The extras of the README and of Getting started against pyproject.toml: the library alone
    is light, the command line has its extra (which ``make run`` installs), Ray's includes its
    client, the docs' tools are an extra that ``dev`` includes, and the license is an SPDX string
    (a table makes setuptools warn on every install) with its LICENSE file."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    core = {re.split(r"[<>=\[;]", dep)[0] for dep in project["dependencies"]}
    assert core == {"gymnasium", "numpy", "cloudpickle", "psutil"}
    extras = project["optional-dependencies"]
    assert {re.split(r"[<>=]", dep)[0] for dep in extras["cli"]} == {"rich", "matplotlib"}
    assert {re.split(r"[<>=\[]", dep)[0] for dep in extras["docs"]} == {
        "mkdocs",
        "mkdocs-material",
        "mkdocstrings",
        "griffe",  # docs/griffe_defaults.py imports it
    }
    assert any("docs" in dep for dep in extras["dev"] if dep.startswith("envfleet["))
    assert any(dep.startswith("ray[client]") for dep in extras["ray"])
    assert "envfleet[cli,atari]" in extras["default"]
    assert project["scripts"]["envfleet"] == "envfleet.__main__:main"
    # The package says what it is: classifiers and its annotations (PEP 561). No links: the
    # project has no public address yet, and a guessed one would send users elsewhere.
    assert "urls" not in project
    assert "Typing :: Typed" in project["classifiers"]
    assert "Programming Language :: Python :: 3.10" in project["classifiers"]
    assert project["license-files"] == ["LICENSE"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-data"]["envfleet"] == ["py.typed"]
    assert (ROOT / "envfleet" / "py.typed").is_file()
    getting_started = PAGES["docs/getting-started.md"]
    assert {re.split(r"[<>=]", dep)[0] for dep in extras["torch"]} == {"torch"}
    for extra in ("cli", "atari", "ray", "sb3", "torch", "legacy"):
        assert f"`envfleet[{extra}]`" in README
        assert f"`envfleet[{extra}]`" in getting_started
