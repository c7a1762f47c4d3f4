"""The Gymnasium registry entries of the process that made a pool, carried to its workers.

A factory may call ``gymnasium.make(id)`` on an id the caller registered; a forked worker
inherits the caller's registry, a spawned or forkserver worker and a Ray actor do not.
:class:`CallerRegistry` is what travels with an :class:`~envfleet.spec.EnvSpec` for them: the
entries a fresh ``import gymnasium`` does not make (:func:`_fresh_registry` runs Gymnasium's
own registrations again, into a dict of their own, to tell).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import weakref
from dataclasses import dataclass
from typing import Any

import cloudpickle
import gymnasium

__all__ = ["CallerRegistry"]


@dataclass(frozen=True, eq=False)
class CallerRegistry:
    """The Gymnasium registry entries of the process that made a pool, for its workers.

    A factory may call ``gymnasium.make(id)`` on an id that the caller registered
    (``import ale_py`` registers the ALE ids; ``gymnasium.register`` a user's): a forked worker
    inherits them, a spawned or forkserver worker and a Ray actor do not. The entries that a
    fresh ``import gymnasium`` does not make (any other than Gymnasium's own, field for field:
    a new id or a built-in one registered again, whatever its entry point) and
    that can travel (an entry point named by a string, or a callable cloudpickle takes) go with
    the recipe; :meth:`install` puts them in a worker's registry (the caller's entry wins over
    one of the same id there), and never in the caller's own process.
    """

    entries: tuple[Any, ...]
    pid: int

    @classmethod
    def snapshot(cls) -> CallerRegistry:
        """This process's entries (cached until the registry changes)."""
        values = tuple(gymnasium.registry.values())
        key = tuple(map(id, values))
        cached = _SNAPSHOT.get(key)
        if cached is not None and cached.pid == os.getpid():
            return cached
        entries = tuple(spec for spec in values if not _gymnasiums_own(spec))
        try:
            cloudpickle.dumps(entries)
        except Exception:  # an entry that cannot travel stays behind (the others still go)
            entries = tuple(spec for spec in entries if _travels(spec))
        snapshot = cls(entries, os.getpid())
        _SNAPSHOT.clear()
        _SNAPSHOT[key] = snapshot
        return snapshot

    def install(self) -> None:
        """Register the caller's entries in this process (once; not in the caller's)."""
        if self.pid == os.getpid() or self in _INSTALLED:
            return
        registry = gymnasium.registry
        for spec in self.entries:
            if registry.get(spec.id) != spec:
                registry[spec.id] = spec
        _INSTALLED.add(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Each entry travels on its own: one whose entry point the worker cannot import (a
        # module of the caller's only, say a test suite's) stays behind there, and a pool of
        # another env still starts (an env that needs it fails by its own id: NameNotFound).
        return _arrived, (tuple(cloudpickle.dumps(spec) for spec in self.entries), self.pid)


def _arrived(blobs: tuple[bytes, ...], pid: int) -> CallerRegistry:
    """A :class:`CallerRegistry` as it arrives in a worker: the entries it can rebuild."""
    entries = []
    for blob in blobs:
        try:
            entries.append(pickle.loads(blob))
        except Exception:
            continue
    return CallerRegistry(tuple(entries), pid)


_SNAPSHOT: dict[tuple[int, ...], CallerRegistry] = {}
_INSTALLED: weakref.WeakSet[CallerRegistry] = weakref.WeakSet()  # installed in this process


def _gymnasiums_own(spec: Any) -> bool:
    """An entry exactly as ``import gymnasium`` makes it in every process: same id, entry
    points, time limit, kwargs... (an id the caller registered, or registered again, with
    Gymnasium's own class as its entry point is not one: it must travel)."""
    own = _fresh_registry()
    if own is None:  # unknown: sending it costs a few bytes, leaving it behind a wrong env
        return False
    fresh = own.get(spec.id)
    return fresh is not None and _comparable(fresh) == _comparable(spec)


@functools.cache
def _fresh_registry() -> dict[str, Any] | None:
    """The entries a fresh ``import gymnasium`` registers, whatever this process registered
    since: ``gymnasium.envs``' registrations run again into a dict of their own (the real
    registry untouched); ``None`` if that cannot be done (then every entry travels)."""
    import builtins

    import gymnasium.envs
    from gymnasium.envs import registration

    fresh: dict[str, Any] = {}

    def record(id: str, entry_point: Any = None, **fields: Any) -> None:
        kwargs = fields.pop("kwargs", None) or {}
        spec = registration.EnvSpec(id=id, entry_point=entry_point, kwargs=kwargs, **fields)
        fresh[spec.id] = spec

    class Registration:  # what the module imports from gymnasium.envs.registration
        def __getattr__(self, name: str) -> Any:
            return record if name == "register" else getattr(registration, name)

    real_import = builtins.__import__

    def import_(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == registration.__name__:
            return Registration()
        return real_import(name, *args, **kwargs)

    try:
        path = gymnasium.envs.__file__
        if path is None:
            return None
        with open(path, encoding="utf-8") as source:
            code = compile(source.read(), path, "exec")
        own_builtins = {**vars(builtins), "__import__": import_}
        namespace = {"__name__": gymnasium.envs.__name__, "__builtins__": own_builtins}
        exec(code, namespace)  # Gymnasium's own module, run again
    except Exception:
        return None
    return fresh


def _comparable(spec: Any) -> tuple[Any, ...]:
    """An entry's fields, its callables by name (a run again defines its functions anew)."""

    def named(value: Any) -> Any:
        if callable(value) and not isinstance(value, type):
            module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
            return "callable", module, name
        return value

    return tuple(named(getattr(spec, f.name)) for f in dataclasses.fields(spec))


def _travels(spec: Any) -> bool:
    try:
        cloudpickle.dumps(spec)
    except Exception:
        return False
    return True
