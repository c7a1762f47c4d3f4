"""The ``ray`` backend: one Ray actor per worker, or one sub-pool per node.

Registered as the ``ray`` backend's module, it sits above both families it chooses between
(:mod:`envfleet.backends.ray`, one actor per worker, and :mod:`envfleet.backends.nodes`, node
sub-pools, which builds on the first), so that neither imports the other's chooser and the
per-actor family never imports the node sub-pools.

A pool runs node sub-pools when it asks for them (``nodes=``), or when it leaves ``nodes`` out
and runs on a node of a cluster whose placement is its own, with more than one alive node that
has CPUs and what ``worker_resources`` asks for
(:func:`~envfleet.backends.nodes.placement.spans_nodes`).
A pool that talks to Ray through a Ray Client connection (``ray://``) is on no node: it reaches
neither the agents' sockets nor a node's memory, and runs one actor per worker.
"""

from __future__ import annotations

from envfleet.backends.contract.base import Transport, TransportOptions
from envfleet.backends.nodes.placement import spans_nodes
from envfleet.backends.nodes.transport import NodeTransport
from envfleet.backends.ray import session as ray_session
from envfleet.backends.ray.options import RayOptions
from envfleet.backends.ray.transport import RayTransport


def open_transport(options: TransportOptions) -> Transport:
    """The pool's transport: :class:`RayTransport` (one actor per worker) or
    :class:`NodeTransport` (one sub-pool per node)."""
    extra = options.backend_options
    extra = extra if isinstance(extra, RayOptions) else RayOptions()
    if extra.nodes is False:  # its options were checked for that (RayOptions.check_per_worker)
        return RayTransport(options)
    # Held while the transport starts (it connects too): a private Ray is started once.
    connected = ray_session.connect(
        extra.address, dict(extra.ray_init_kwargs), extra.connect_timeout
    )
    try:
        if ray_session.client_connected():
            # The pool's process is on no node (ray://): it can reach neither the agents'
            # sockets nor a node's memory, so one actor per worker, each command a Ray call.
            if extra.nodes is not None:
                raise ValueError(
                    f"nodes={extra.nodes!r} runs node sub-pools, whose agents the pool's process "
                    "must reach; over a Ray Client connection (ray://) it reaches none: leave "
                    "nodes out (one Ray actor per worker), or run the pool on a node of the "
                    "cluster (address='auto')"
                )
            extra.check_per_worker()
            return RayTransport(options)
        if extra.nodes is None and not spans_nodes(extra):
            extra.check_per_worker()
            return RayTransport(options)
        return NodeTransport(options)
    finally:
        if connected:
            ray_session.disconnect()


__all__ = ["open_transport"]
