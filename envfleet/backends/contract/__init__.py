"""What every backend shares: the contract and the pieces more than one family uses.

- :mod:`~envfleet.backends.contract.base`: :class:`Transport` (the conversation with the
  workers) and :class:`Workers` (their lifecycle), all the pool ever calls, with
  :class:`BaseTransport` and :class:`BaseWorkers` (their defaults), the capabilities only some
  backends have (:class:`HasSpares`, :class:`HasNodes`, :class:`SubmitsMany`),
  :class:`TransportOptions`, :class:`WorkerLost`, and
  :class:`LocalPool` (what a node's agent asks of the pool it runs on its node);
- :mod:`~envfleet.backends.contract.registry`: every backend, what it can do, and
  ``open_transport`` (each family's module imported only when a pool is made);
- :mod:`~envfleet.backends.contract.rows`: rows shipped back as :class:`~envfleet.protocol.Rows`
  and written into the batch;
- :mod:`~envfleet.backends.contract.spares`: spare observation rows the pool hands out;
- :mod:`~envfleet.backends.contract.channel`: the framed, pickled wire between a pool and a
  worker's loop, and the authenticated sockets;
- :mod:`~envfleet.backends.contract.outbox`: bytes a non-blocking socket or pipe took only part
  of.

The contract imports no family: the families (``local`` ← ``ray`` ← ``nodes``) import it.
"""

__all__: list[str] = []
