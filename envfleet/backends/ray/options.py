"""The ray backend's own options: keyword arguments of :func:`envfleet.make` routed to it.

A module of its own so that :func:`envfleet.make` can check them without importing Ray (an
optional extra); :mod:`envfleet.backends.ray.transport` reads them from
``TransportOptions.backend_options``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CONNECT_TIMEOUT = 20.0
"""The default of ``connect_timeout`` (``envfleet.backends.ray.joining.CONNECT_TIMEOUT`` is
the same figure: this module imports no Ray)."""

COMPRESS = ("lz4", "zlib")
"""The values of ``compress=`` besides ``None`` (:mod:`envfleet.backends.nodes.compression`)."""


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
    nodes: str | Sequence[str] | bool | None = None
    """Node sub-pools (:mod:`envfleet.backends.nodes`): an agent on each node runs its share of
    the workers (in proportion to its CPUs, in contiguous runs) as local processes, and each
    command is one message per node; the pool's own node runs its share as actors on the pool's
    memory (with ``ray_shared_memory=False``, an agent too). ``None`` (default): node sub-pools
    when the pool's process is on a node of a cluster with more than one alive node that has
    CPUs (and the resources of ``worker_resources``), unless ``worker_resources`` places the
    actors itself (``scheduling_strategy``, ``placement_group``) or ``ray_shared_memory=False``;
    else one actor per worker. ``"auto"`` (every such node) or a list of Ray node ids: node
    sub-pools always. ``False``: one actor per worker always."""
    compress: str | None = None
    """Node sub-pools only: ``"lz4"`` (the ``lz4`` package, in the ``ray`` extra) or
    ``"zlib"`` compresses the image observations (arrays of numbers, ``uint8`` or float, of two
    or more dimensions a row) each node sends the pool, losslessly: a step's rows, and a
    rollout's frames a block per step; ``None`` (default): raw bytes
    (:mod:`envfleet.backends.nodes.compression`)."""

    connect_timeout: float = CONNECT_TIMEOUT
    """Seconds that joining a cluster (``address`` a ``host:port``, ``"auto"`` or
    ``"ray://host:port"``) may take in all (default 20). Nothing listening at the address fails
    at once; past the timeout, as when something that is not Ray answers there, the join fails
    with a :class:`ConnectionError` naming the address and how to start a Ray there. A private
    local Ray (no ``address``, or ``"local"``) and a Ray this process is already connected to
    are not bounded by it."""

    def __post_init__(self) -> None:
        timeout = self.connect_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(
                f"connect_timeout must be a number of seconds, got {type(timeout).__name__}"
            )
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"connect_timeout must be a positive number of seconds, got {timeout}")
        object.__setattr__(self, "connect_timeout", float(timeout))
        if self.compress is not None and self.compress not in COMPRESS:
            raise ValueError(
                f"compress must be one of {', '.join(map(repr, COMPRESS))} or None, "
                f"got {self.compress!r}"
            )
        if self.nodes is False:
            self.check_per_worker()
        # Copies: the caller's mappings may change after make() returns.
        object.__setattr__(self, "ray_init_kwargs", dict(self.ray_init_kwargs))
        object.__setattr__(self, "worker_resources", dict(self.worker_resources))
        object.__setattr__(self, "ray_shared_memory", self.ray_shared_memory is not False)
        nodes = self.nodes
        if nodes is True:
            raise ValueError("nodes must be None, False, 'auto' or a list of Ray node ids")
        if nodes is not None and nodes is not False and nodes != "auto":
            if isinstance(nodes, str) or not nodes or not all(isinstance(n, str) for n in nodes):
                raise ValueError(
                    "nodes must be None, False, 'auto' or a non-empty list of Ray node ids, "
                    f"got {nodes!r}"
                )
            object.__setattr__(self, "nodes", tuple(nodes))

    def check_per_worker(self) -> None:
        """Raise ``ValueError`` for what a pool of one actor per worker cannot do."""
        if self.compress is not None:
            raise ValueError(
                f"compress={self.compress!r} compresses what node sub-pools send the pool, and "
                "this pool runs one Ray actor per worker (nodes=False, or a Ray of one node): "
                "give nodes='auto' or a list of Ray node ids"
            )


__all__ = ["COMPRESS", "CONNECT_TIMEOUT", "RayOptions"]
