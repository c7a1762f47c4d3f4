"""Transports that carry commands from the pool to its env groups and replies back.

The backends come in families, each importing only those before it::

    contract  ←  local  ←  ray  ←  nodes        (ray_backend: above ray and nodes)

- :mod:`~envfleet.backends.contract`: the contract every backend implements and all the pool
  ever calls (:class:`Transport`, the conversation with the workers; :class:`Workers`, their
  lifecycle; the capabilities only some have: :class:`HasSpares`, :class:`HasNodes`,
  :class:`SubmitsMany`, :class:`LandsParts`), the registry of backends, and the pieces more
  than one family shares;
- :mod:`~envfleet.backends.local`: ``serial``, ``thread`` and ``process``, on this machine;
- :mod:`~envfleet.backends.ray`: one Ray actor per worker;
- :mod:`~envfleet.backends.nodes`: one sub-pool per Ray node, each run by an agent on its node;
- :mod:`~envfleet.backends.ray_backend`: the ``ray`` backend, which picks one of the two.

This package re-exports the contract; nothing here imports a family.
"""

from envfleet.backends.contract.base import (
    BaseTransport,
    BaseWorkers,
    HasNodes,
    HasSpares,
    LandsParts,
    LocalPool,
    Replies,
    SubmitsMany,
    Transport,
    TransportOptions,
    WorkerLost,
    Workers,
)
from envfleet.backends.contract.registry import (
    Backend,
    Capabilities,
    TransportKind,
    open_transport,
    refusal,
    register,
    unregister,
)

__all__ = [
    "Backend",
    "BaseTransport",
    "BaseWorkers",
    "Capabilities",
    "HasNodes",
    "HasSpares",
    "LandsParts",
    "LocalPool",
    "Replies",
    "SubmitsMany",
    "Transport",
    "TransportKind",
    "TransportOptions",
    "WorkerLost",
    "Workers",
    "open_transport",
    "refusal",
    "register",
    "unregister",
]
