"""The API reference as a reader meets it: every example runs (doctest) and is shown as code,
``Returns`` name their type, defaults read as values, the Pool page has the ``VectorEnv``
methods it inherits, and every public name has an entry; no test marker shows on any page."""

from __future__ import annotations

import doctest
import html
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import envfleet

ROOT = Path(__file__).resolve().parent.parent

DOCUMENTED_MODULES = (
    "envfleet",
    "envfleet._make",
    "envfleet.pool",
    "envfleet.rollouts",
    "envfleet.errors",
    "envfleet.spec",
    "envfleet.stats",
    "envfleet.registration",
    "envfleet.backends.contract.registry",
    "envfleet.gymnasium_async",
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_the_examples_in_the_docstrings_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name, globs={}):
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} failing examples in {module_name}"


def test_the_public_examples_are_examples_sections() -> None:
    """``Examples:`` is the Google-style section the reference renders as code; ``Example:``
    renders the ``>>>`` lines as nested quotes of run-on text."""
    for name in ("make", "Pool", "Rollout", "RandomPolicy", "EnvError", "EnvSpec"):
        doc = getattr(envfleet, name).__doc__ or ""
        assert "Examples:\n" in doc and ">>>" in doc, name
    assert "Examples:\n" in (envfleet.Pool.stats.__doc__ or "")
    assert "Examples:\n" in (envfleet.Pool.rollout.__doc__ or "")
    for module_name in DOCUMENTED_MODULES:
        source = (
            (ROOT / (module_name.replace(".", "/") + ".py")).read_text()
            if "." in module_name
            else ""
        )
        assert not re.search(r"^\s+Example:\s*$", source, flags=re.M), module_name


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    command = [mkdocs] if mkdocs else [sys.executable, "-m", "mkdocs"]
    result = subprocess.run(
        [*command, "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def text_of(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


@pytest.mark.timeout(180)
def test_examples_render_as_code_and_not_as_quotes(site: Path) -> None:
    for name in ("api/make", "api/pool", "api/rollouts", "api/errors", "api/registration"):
        markup = page(site, name)
        assert "<blockquote>\n<blockquote>" not in markup, name
        assert not re.search(r"<p>[^<]*&gt;&gt;&gt;", markup), name
        # the examples are highlighted Python
        assert 'class="language-python highlight"' in markup or "highlight" in markup, name
        assert "&gt;&gt;&gt;" in markup or ">>>" in text_of(markup), name


@pytest.mark.timeout(180)
def test_returns_defaults_and_inherited_methods(site: Path) -> None:
    make = text_of(page(site, "api/make"))
    assert "DEFAULT_START_TIMEOUT" not in make and "DEFAULT_MAX_RESTARTS" not in make
    assert "start_timeout: float = 120.0" in make
    assert "max_restarts: int = 100" in make
    assert "backend: str | Backend | TransportKind = 'process'" in make.replace('"', "'")
    assert "class: Pool" not in make and ":class:" not in make
    returns = make.split("Returns:")[1][:300]
    assert "Pool" in returns and not returns.strip().startswith("A ")

    pool = page(site, "api/pool")
    for method in (
        "step_async",
        "step_wait",
        "reset_async",
        "reset_wait",
        "call_async",
        "call_wait",
        "rollout",
        "send",
        "recv",
        "stats",
    ):
        assert f'id="envfleet.Pool.{method}"' in pool, method
    assert 'id="envfleet.Pool.__init__"' not in pool
    assert not re.search(r"Pool\(\s*transport", text_of(pool))  # no internal signature

    rollouts = re.sub(r"\s+", " ", text_of(page(site, "api/rollouts")))
    assert "rewards: ndarray The rewards, float64 (steps, num_envs)" in rollouts
    for flag in ("terminations", "truncations"):
        assert re.search(rf"{flag}: ndarray Whether each env's episode [^.]*bool", rollouts), flag


@pytest.mark.timeout(180)
def test_every_public_name_has_an_entry(site: Path) -> None:
    api = "".join(
        page(site, f"api/{name}")
        for name in ("make", "pool", "rollouts", "errors", "registration", "sb3")
    )
    ids = set(re.findall(r'id="([\w.]+)"', api))
    headings = text_of(api)
    for name in envfleet.__all__:
        if name == "__version__":
            continue
        documented = (
            f"envfleet.{name}" in ids
            or f"envfleet.errors.{name}" in ids
            or f"envfleet.{name}" in headings
        )
        assert documented, name
    registration = page(site, "api/registration")
    assert 'id="envfleet.EnvSpec.from_user"' in registration
    assert 'id="envfleet.EnvSpec.of_envs"' not in registration
    assert 'id="envfleet.EnvSpec.for_env"' not in registration


@pytest.mark.timeout(180)
def test_the_nav_and_the_pages_show_no_test_markers(site: Path) -> None:
    for path in site.rglob("*.html"):
        shown = text_of(path.read_text())
        assert "readme-test" not in shown, path
    index = page(site, "api")
    assert "API reference \N{SINGLE RIGHT-POINTING ANGLE QUOTATION MARK} API reference" not in (
        text_of(index)
    )
    assert "<title>Overview - envfleet</title>" in index  # the section's first entry
