"""The README and the install: every Python block of the README runs as written, every ``envfleet``
command it shows parses, and its extras table matches ``pyproject.toml``.

The blocks run one after another in one subprocess (one start of Python, one of Ray for the
blocks that use it), each in a fresh namespace, so that a new block is tested without any change
here. A block that cannot run in a test says so on its first line, with the reason:
``# readme-test: skip (why)``; use it sparingly.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from envfleet.cli import build_parser
from envfleet.spec import EnvSpec

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SKIP = re.compile(r"^# readme-test: skip \((?P<reason>[^)]+)\)")

RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
for index, source in blocks:
    try:
        exec(compile(source, f"README.md block {index}", "exec"), {"__name__": "__readme__"})
    except BaseException:
        print(json.dumps({"block": index, "error": traceback.format_exc()}), flush=True)
    else:
        print(json.dumps({"block": index, "error": None}), flush=True)
try:
    import ray
    if ray.is_initialized():
        ray.shutdown()
except ImportError:
    pass
"""


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_python_blocks_and_skips_only_with_a_reason() -> None:
    python = blocks("python")
    assert len(python) >= 5
    for source in python:
        first = source.splitlines()[0] if source.strip() else ""
        if first.startswith("# readme-test"):
            assert SKIP.match(first), f"a skip marker needs a reason: {first!r}"


@pytest.mark.timeout(180)
def test_every_python_block_runs() -> None:
    to_run = [
        (index, source)
        for index, source in enumerate(blocks("python"), start=1)
        if not SKIP.match(source)
    ]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(to_run),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=170,
        check=False,
    )
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["block"] for r in reports] == [index for index, _ in to_run], result.stderr[-3000:]
    failures = [f"block {r['block']}:\n{r['error']}" for r in reports if r["error"] is not None]
    assert not failures, "\n".join(failures)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_envfleet_command_in_the_readme_parses() -> None:
    commands = [
        line.split("#")[0].strip()
        for block in blocks("sh")
        for line in block.splitlines()
        if line.startswith(("envfleet ", "python -m envfleet "))
    ]
    assert len(commands) >= 8
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)
        argv = argv[3:] if argv[0] == "python" else argv[1:]
        if "--help" in argv:
            continue
        args, unknown = parser.parse_known_args(argv)
        assert not unknown, (command, unknown)
        assert args.handler is not None
        if ":" not in args.env and not args.imports:  # runs as written: the id is registered
            EnvSpec.from_user(args.env)


def test_the_install_matches_what_the_readme_says() -> None:
    """The extras table of the README against pyproject.toml: the library alone is light, the
    command line has its extra (which ``make run`` installs), Ray's includes its client, and the
    license is an SPDX string (a table makes setuptools warn on every install)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    core = {re.split(r"[<>=\[;]", dep)[0] for dep in project["dependencies"]}
    assert core == {"gymnasium", "numpy", "cloudpickle", "psutil"}
    extras = project["optional-dependencies"]
    assert {re.split(r"[<>=]", dep)[0] for dep in extras["cli"]} == {"rich", "matplotlib"}
    assert any(dep.startswith("ray[client]") for dep in extras["ray"])
    assert "envfleet[cli,atari]" in extras["default"]
    assert project["scripts"]["envfleet"] == "envfleet.__main__:main"
    for extra in ("cli", "atari", "ray", "sb3", "legacy"):
        assert f"`envfleet[{extra}]`" in README
