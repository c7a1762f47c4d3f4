"""Transports that carry commands from the pool to its env groups and replies back.

:mod:`~envfleet.backends.base` is the contract, :mod:`~envfleet.backends.registry` the list of
backends; each backend is one module (two for Ray: the pool's side and its actor's).
"""

from envfleet.backends.base import BaseTransport, Transport, TransportOptions, WorkerLost
from envfleet.backends.registry import (
    Backend,
    Capabilities,
    TransportKind,
    open_transport,
    register,
    unregister,
)

__all__ = [
    "Backend",
    "BaseTransport",
    "Capabilities",
    "Transport",
    "TransportKind",
    "TransportOptions",
    "WorkerLost",
    "open_transport",
    "register",
    "unregister",
]
