"""The user pages teach rather than log: a cluster page that sets up two machines, a benchmarks
page of current tables with their commands, one figure per claim across the README, the home
page and the benchmarks, an install line for a project not yet on the package index, and the
dated runs kept to the development notes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def page(name: str) -> str:
    return (DOCS / name).read_text()


USER_PAGES = sorted(
    path
    for path in DOCS.rglob("*.md")
    if path.relative_to(DOCS).parts[0] not in ("api", "development")
)


@pytest.mark.parametrize("path", USER_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_user_pages_are_not_measurement_diaries(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 260, "a page a reader scrolls through, not a log"
    assert text.count("load average") <= 2
    for phrase in ("a day later", "Targets", "before and after", "Later the same day"):
        assert phrase not in text, phrase


def test_the_cluster_page_sets_up_two_machines_and_says_what_fails() -> None:
    cluster = page("cluster.md")
    assert "ray start --head" in cluster
    assert "ray start --address=" in cluster
    for heading in (
        "## Set up two machines",
        "### Firewall: the ports to open",
        "## Run a pool on them",
        "## Place the envs",
        "## What a step costs",
        "## Faults",
        "## Troubleshooting",
    ):
        assert heading in cluster, heading
    assert "6379" in cluster and "ip_local_port_range" in cluster
    assert "No Ray at the address" in cluster
    assert "cannot import your env" in cluster
    assert (DOCS / "tutorials" / "train-on-a-cluster.md").is_file()


def test_every_benchmark_table_has_its_command_and_machine() -> None:
    bench = page("benchmarks.md")
    sections = re.split(r"^## ", bench, flags=re.M)[1:]
    measured = [s for s in sections if "|---" in s and not s.startswith("At a glance")]
    assert len(measured) >= 5
    for section in measured:
        title = section.splitlines()[0]
        assert "```sh\n" in section or "`envfleet bench" in section, title
        assert "2-core" in section, title
        assert re.search(r"20\d\d-\d\d-\d\d", section) or "bench.json" in section, title
    assert "## Methods" in bench
    assert "stale" not in bench


FIGURES = ("5.12k", "1.38\N{MULTIPLICATION SIGN}", "14.8k", "44.3k", "42 µs")


def test_one_figure_per_claim_in_the_readme_the_home_page_and_the_benchmarks() -> None:
    bench, index = page("benchmarks.md"), page("index.md")
    for figure in FIGURES:
        assert figure in bench, figure
        assert figure in index, figure
    for figure in FIGURES[:4]:
        assert figure in README, figure
    # the older runs' Pong and serial figures
    for stale in ("3.00k", "1.22\N{MULTIPLICATION SIGN}", "94.6k"):
        for name, text in (("README", README), ("index", index), ("benchmarks", bench)):
            assert stale not in text, (name, stale)


def test_the_install_lines_work_before_the_package_index() -> None:
    index = page("index.md")
    assert re.search(r"```sh\npip install ", index)
    getting_started = page("getting-started.md")
    assert "pip install -e '/path/to/envfleet[cli]'" in getting_started
    assert "@ git+https://" in getting_started
    makefile = (ROOT / "Makefile").read_text()
    docs_target = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert ".installed-docs" in docs_target and ".installed-dev" not in docs_target
    assert 'pip install --quiet -e ".[docs]"' in makefile


def test_the_dated_runs_live_in_the_development_notes() -> None:
    notes = DOCS / "development" / "notes.md"
    assert notes.is_file()
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert "development/notes.md" in mkdocs
    assert "tutorials/train-on-a-cluster.md" in mkdocs
