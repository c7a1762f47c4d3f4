"""The backend registry: every backend, what it can do and which options it owns.

Each backend is declared once, as a :class:`TransportKind`: the module that implements it
(imported only when a pool is made: Ray is an optional extra), the options of
:func:`envfleet.make` it honours (:class:`Capabilities`) and its own options dataclass, whose
fields are keyword arguments of :func:`envfleet.make` routed to it. ``make()`` asks these
declarations and never names a backend; so do its error messages (:func:`refusal`).

The built-in backends are the :class:`Backend` members; another is added with
:func:`register` (a module with an ``open_transport(options)`` function, see
:mod:`envfleet.backends.contract.base`) and then chosen by its name:
``make(..., backend="name")``. The registry imports no backend: a family's module (and its
options dataclass, named by where it lives) is imported when it is asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

from envfleet.backends.contract.base import Transport, TransportOptions


class Backend(enum.Enum):
    """The built-in backends: where the envs run. ``make(backend=)`` takes the member or its
    name in any case (``"process"``, ``"Process"``); see the user guide's "Choosing a backend".

    Attributes:
        SERIAL: in the caller's thread, one after another: the reference semantics, for
            debugging.
        THREAD: threads of the caller's process: envs that sleep, wait on I/O or release the
            GIL, and are thread-safe.
        PROCESS: worker processes writing their rows into shared memory (the default): any env,
            isolated from crashes.
        RAY: Ray actors, on this machine or a cluster (``address=``); one sub-pool per node.
    """

    SERIAL = "serial"
    THREAD = "thread"
    PROCESS = "process"
    RAY = "ray"


def _can(needs: str) -> Any:
    """A capability flag, off by default; ``needs`` completes "``option`` needs a backend ..."
    in the message that refuses it."""
    return field(default=False, metadata={"needs": needs})


@dataclass(frozen=True)
class Capabilities:
    """The options of :func:`envfleet.make` a backend honours (the others are refused)."""

    step_timeout: bool = _can("that can kill a worker")
    """Can it stop a worker that hangs (its envs run outside the caller's process)?"""
    threads_per_worker: bool = _can("that can step a worker's envs on several threads")
    """Can one worker step its envs on several threads?"""
    cpu_affinity: bool = _can("with workers to pin")
    """Has it workers to pin?"""
    local_cpus: bool = True
    """Do its workers run on this machine (so ``cpu_affinity`` names this machine's CPUs)?"""
    worker_memory_limit: bool = _can("that can measure and replace a worker process")
    """Can it measure and replace a worker that uses too much memory?"""
    start_timeout: bool = False
    """Does it bound the time a worker takes to build its envs?"""
    one_worker: bool = False
    """Does it run every env in one worker whatever ``num_workers`` says?"""
    worker_per_env: bool = False
    """Is its default one worker per env (threads, for envs that wait) rather than per CPU?"""


@dataclass(frozen=True)
class TransportKind:
    """A backend: where its transport lives, what it can do and the options it owns."""

    name: str
    """What ``make(backend=...)`` calls it."""
    module: str
    """The module whose ``open_transport(options)`` starts its transport."""
    capabilities: Capabilities = Capabilities()
    options: type | str | None = None
    """Its own options: a dataclass whose fields are keyword arguments of ``make()``, or where
    it lives as ``"module:Name"`` (imported when asked for: the registry imports no backend)."""
    requires: str | None = None
    """A module it cannot run without (an optional extra) ..."""
    install: str | None = None
    """... and what to install ("Ray: pip install 'envfleet[ray]'")."""

    def options_type(self) -> type | None:
        """Its options dataclass (imported now when :attr:`options` names where it lives)."""
        if not isinstance(self.options, str):
            return self.options
        module, _, name = self.options.partition(":")
        found: type = getattr(importlib.import_module(module), name)
        return found

    def option_names(self) -> frozenset[str]:
        """The keyword arguments of ``make()`` this backend owns."""
        options = self.options_type()
        if options is None:
            return frozenset()
        return frozenset(f.name for f in dataclasses.fields(options))

    def __str__(self) -> str:
        return self.name


_BUILT_IN = (
    TransportKind("serial", "envfleet.backends.local.serial", Capabilities(one_worker=True)),
    TransportKind(
        "thread",
        "envfleet.backends.local.thread",
        Capabilities(cpu_affinity=True, start_timeout=True, worker_per_env=True),
    ),
    TransportKind(
        "process",
        "envfleet.backends.local.shared_weights",  # process.py's, each version's weights shared
        Capabilities(
            step_timeout=True,
            threads_per_worker=True,
            cpu_affinity=True,
            worker_memory_limit=True,
            start_timeout=True,
        ),
    ),
    TransportKind(
        "ray",
        "envfleet.backends.ray_backend",
        Capabilities(
            step_timeout=True,
            threads_per_worker=True,
            cpu_affinity=True,
            local_cpus=False,
            worker_memory_limit=True,
            start_timeout=True,
        ),
        options="envfleet.backends.ray.options:RayOptions",
        requires="ray",
        install="Ray: pip install 'envfleet[ray]'",
    ),
)

_lock = threading.Lock()
KINDS: dict[str, TransportKind] = {kind.name: kind for kind in _BUILT_IN}
"""Every backend, by name; readable without importing any backend's module."""


def register(kind: TransportKind) -> TransportKind:
    """Add a backend; ``make(backend=kind.name)`` then runs on it. Returns ``kind``.

    Raises:
        ValueError: another backend has that name, or owns one of its options' names.
    """
    with _lock:
        known = KINDS.get(kind.name)
        if known is not None and known != kind:
            raise ValueError(f"a backend named {kind.name!r} is registered already")
        for other in KINDS.values():
            shared = other.option_names() & kind.option_names()
            if other.name != kind.name and shared:
                raise ValueError(
                    f"backend {other.name!r} owns the option(s) {sorted(shared)} already"
                )
        KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a backend added by :func:`register` (the built-in ones stay)."""
    if name in {b.value for b in Backend}:
        raise ValueError(f"{name!r} is a built-in backend")
    with _lock:
        KINDS.pop(name, None)


def kind_of(backend: str | Backend | TransportKind) -> TransportKind:
    """The registered backend ``backend`` names: a :class:`Backend`, a name in any case
    (``"process"``, ``"PROCESS"``) or a :class:`TransportKind` (which must be registered)."""
    if isinstance(backend, TransportKind):
        name = backend.name
    elif isinstance(backend, Backend):
        name = backend.value
    else:
        name = backend.lower() if isinstance(backend, str) else backend
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None or (isinstance(backend, TransportKind) and kind != backend):
        choices = ", ".join(repr(k) for k in KINDS)
        raise ValueError(f"unknown backend {backend!r}: expected one of {choices}")
    return kind


def capable(option: str) -> list[TransportKind]:
    """The backends whose :class:`Capabilities` say yes to ``option``, in registration order."""
    return [kind for kind in KINDS.values() if getattr(kind.capabilities, option)]


def refusal(option: str, kind: TransportKind) -> str:
    """Why ``option`` cannot be given to ``kind``, from its capability: "step_timeout needs a
    backend that can kill a worker: process, ray; got backend='thread'"."""
    needs = {f.name: f.metadata.get("needs") for f in dataclasses.fields(Capabilities)}[option]
    names = ", ".join(k.name for k in capable(option))
    return f"{option} needs a backend {needs}: {names}; got backend={kind.name!r}"


def backend_options(kind: TransportKind, given: dict[str, Any]) -> Any:
    """``kind``'s own options from the keyword arguments of ``make()`` that are not ``None``.

    Raises:
        ValueError: an option belongs to another backend.
        TypeError: no backend owns it.
    """
    given = {name: value for name, value in given.items() if value is not None}
    mine = kind.option_names()
    for name in given:
        if name in mine:
            continue
        owners = [k.name for k in KINDS.values() if name in k.option_names()]
        if not owners:
            raise TypeError(f"make() got an unexpected keyword argument {name!r}")
        names = " or ".join(f"backend={owner!r}" for owner in owners)
        raise ValueError(f"{name} is an option of {names}; got backend={kind.name!r}")
    options = kind.options_type()
    if options is None:
        return None
    return options(**given)


def open_transport(kind: TransportKind, options: TransportOptions) -> Transport:
    """Start the transport of ``kind`` (its module imported now: Ray is an optional extra)."""
    try:
        module = importlib.import_module(kind.module)
    except ImportError as exc:
        if kind.requires is not None and exc.name == kind.requires:
            raise ImportError(
                f"backend={kind.name!r} needs {kind.install}", name=kind.requires
            ) from exc
        raise
    transport: Transport = module.open_transport(options)
    return transport


__all__ = [
    "KINDS",
    "Backend",
    "Capabilities",
    "TransportKind",
    "backend_options",
    "capable",
    "kind_of",
    "open_transport",
    "refusal",
    "register",
    "unregister",
]
