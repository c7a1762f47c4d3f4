"""The ray backend's own options: keyword arguments of :func:`envfleet.make` routed to it.

A module of its own so that :func:`envfleet.make` can check them without importing Ray (an
optional extra); :mod:`envfleet.backends.ray` reads them from
``TransportOptions.backend_options``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPRESS = ("lz4", "zlib")
"""The values of ``compress=`` besides ``None`` (:mod:`envfleet.backends.compression`)."""


@dataclass(frozen=True)
class RayOptions:
    """``make(backend="ray", address=..., ray_init_kwargs=..., ...)``."""

    address: str | None = None
    """``None`` uses the Ray this process is connected to, else starts a private local one (as
    ``"local"``: never a cluster already running on the machine, nor ``RAY_ADDRESS``);
    ``"local"`` always starts a new local Ray; ``"auto"`` or ``"ray://host:port"`` joins an
    existing cluster. The last pool on a connection envfleet made disconnects it (stopping a
    Ray envfleet started); a Ray the caller connected to is never touched."""
    ray_init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``ray.init``."""
    worker_resources: Mapping[str, Any] = field(default_factory=dict)
    """``.options()`` for each actor, such as ``{"num_cpus": 1}`` or
    ``{"resources": {"sim": 1}}``; actors spread over nodes (``scheduling_strategy="SPREAD"``)
    unless this says otherwise."""
    ray_shared_memory: bool = True
    """Actors on this machine share the batch memory with the pool and take commands over a
    socket, without a Ray call per step (default ``True``); ``False`` makes every command a Ray
    call, as for actors on other nodes."""
    nodes: str | Sequence[str] | None = None
    """``None`` (default): one actor per worker. ``"auto"`` (every alive node with CPUs) or a
    list of Ray node ids: one sub-pool per node (:mod:`envfleet.backends.nodes`): an agent on
    each node runs its share of the workers (in proportion to its CPUs, in contiguous runs) as
    local processes, and each command is one message per node."""
    compress: str | None = None
    """Node sub-pools only: ``"lz4"`` (the ``lz4`` package, in the ``ray`` extra) or
    ``"zlib"`` compresses the image observations (``uint8`` arrays of two or more dimensions a
    row) each node sends the pool, losslessly; ``None`` (default): raw bytes
    (:mod:`envfleet.backends.compression`)."""

    def __post_init__(self) -> None:
        if self.compress is not None and self.compress not in COMPRESS:
            raise ValueError(
                f"compress must be one of {', '.join(map(repr, COMPRESS))} or None, "
                f"got {self.compress!r}"
            )
        # Copies: the caller's mappings may change after make() returns.
        object.__setattr__(self, "ray_init_kwargs", dict(self.ray_init_kwargs))
        object.__setattr__(self, "worker_resources", dict(self.worker_resources))
        object.__setattr__(self, "ray_shared_memory", self.ray_shared_memory is not False)
        nodes = self.nodes
        if nodes is not None and nodes != "auto":
            if isinstance(nodes, str) or not nodes or not all(isinstance(n, str) for n in nodes):
                raise ValueError(
                    f"nodes must be 'auto' or a non-empty list of Ray node ids, got {nodes!r}"
                )
            object.__setattr__(self, "nodes", tuple(nodes))
