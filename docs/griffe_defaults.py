"""A Griffe extension for the API reference (``extensions:`` in ``mkdocs.yml``).

Griffe reads the signatures from the source, so a default written as a name shows as that
name (``start_timeout = DEFAULT_START_TIMEOUT``, ``backend = Backend.PROCESS``): not what a
reader can type. Each such default is shown as its value instead, read from the imported
function: ``60.0``, and an enum member as the value ``make()`` also takes (``'process'``).
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
from typing import Any

import griffe


def shown(value: Any) -> str:
    """How a default reads in the reference: an enum member as its value, else its repr."""
    if isinstance(value, enum.Enum):
        value = value.value
    return repr(value)


def _runtime(path: str) -> Any:
    """The object at ``path`` (``envfleet._make.make``, ``envfleet.pool.Pool.close``), or
    ``None`` where it cannot be imported."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except Exception:  # not a module, or one that needs what is not installed
            continue
        try:
            for name in parts[split:]:
                value = getattr(value, name)
        except AttributeError:
            return None
        return value
    return None


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        return False
    return True


class DefaultValues(griffe.Extension):
    """Replace the defaults written as names with their values."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "envfleet":  # not the packages it reads for inherited members
            self._visit(pkg)

    def _visit(self, obj: griffe.Object) -> None:
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            if isinstance(member, griffe.Function):
                self._fix(member)
            elif isinstance(member, griffe.Class | griffe.Module):
                self._visit(member)

    def _fix(self, func: griffe.Function) -> None:
        named = [
            p for p in func.parameters if p.default is not None and not _is_literal(str(p.default))
        ]
        if not named:
            return
        runtime = _runtime(func.path)
        try:
            signature = inspect.signature(runtime)
        except (TypeError, ValueError):
            return
        for parameter in named:
            actual = signature.parameters.get(parameter.name)
            if actual is not None and actual.default is not inspect.Parameter.empty:
                parameter.default = shown(actual.default)
