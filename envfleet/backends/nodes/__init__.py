"""Node sub-pools: one agent per Ray node runs that node's envs in its own process pool.

- :mod:`~envfleet.backends.nodes.transport`:
  :class:`~envfleet.backends.nodes.transport.NodeTransport`, the pool's side;
- :mod:`~envfleet.backends.nodes.agent`: the Ray actor on each node, whose loop is
  :mod:`~envfleet.backends.nodes.server`; it runs its node's pool through the contract's
  :class:`~envfleet.backends.contract.base.LocalPool`;
- :mod:`~envfleet.backends.nodes.actors`: the agents as Ray actors, started, connected to,
  started again and ended;
- :mod:`~envfleet.backends.nodes.link`: the pool's connection to one agent;
  :mod:`~envfleet.backends.nodes.wire`, :mod:`~envfleet.backends.nodes.frames`,
  :mod:`~envfleet.backends.nodes.raw_rows` and :mod:`~envfleet.backends.nodes.compression`:
  the messages between them;
- :mod:`~envfleet.backends.nodes.placement`: which nodes, and how many workers on each;
- :mod:`~envfleet.backends.nodes.options`: a node's options for its workers (no Ray imported:
  the workers unpickle them);
- :mod:`~envfleet.backends.nodes.driver_node`: the pool's own node, on its shared memory (the
  ray family's actors).

The top of the family order: these may import the contract, the local family and the ray
family; none of those imports them.
"""

__all__: list[str] = []
