"""Transports that carry commands from the pool to its env groups and replies back."""

from envfleet.backends.base import Backend, Transport, TransportOptions, WorkerLost, open_transport

__all__ = ["Backend", "Transport", "TransportOptions", "WorkerLost", "open_transport"]
