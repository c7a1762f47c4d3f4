"""MkDocs hooks for this site (``hooks:`` in ``mkdocs.yml``).

A code block that the tests do not run (it needs a cluster, or a peer library) starts with a
``# readme-test: skip (why)`` line in the page's source; the reader does not see it: it is
taken out before the page is rendered.

The docstrings cross-reference in Sphinx's roles (``:class:`EnvError```, ``:meth:`Pool.recv```),
which mkdocstrings shows as they are written: ``:class:EnvError``. Each role becomes an
optional cross-reference (mkdocs-autorefs links it when the name is documented on the site,
and leaves the code text alone otherwise).
"""

from __future__ import annotations

import html
import re
from typing import Any

SKIP_MARKER = re.compile(r"^(?P<fence>```\w*\n)# readme-test: skip \([^)]*\)\n", flags=re.M)
"""The first line of a code block that the tests skip (see ``tests/test_readme.py``)."""

ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):<code>~?(?P<name>[\w.]+)</code>")


def _autoref(match: re.Match[str]) -> str:
    name = match.group("name")
    identifier = name if name.startswith("envfleet") else f"envfleet.{name}"
    shown = html.escape(name.rsplit(".", 1)[-1] if match.group(0).count("~") else name)
    attrs = f'identifier="{html.escape(identifier)}" optional'
    return f"<autoref {attrs}><code>{shown}</code></autoref>"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Take the tests' skip markers out of the code blocks."""
    return SKIP_MARKER.sub(r"\g<fence>", markdown)


def on_page_content(html_text: str, **kwargs: Any) -> str:
    """Turn the roles left in the rendered docstrings into cross-references."""
    return ROLE.sub(_autoref, html_text)
