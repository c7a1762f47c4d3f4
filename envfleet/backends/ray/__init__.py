"""One Ray actor per worker (Ray is an optional extra: this package's modules import it).

- :mod:`~envfleet.backends.ray.transport`:
  :class:`~envfleet.backends.ray.transport.RayTransport`, the pool's side, with its two paths
  to an actor: :mod:`~envfleet.backends.ray.socket_path` (on the pool's machine, over a Unix
  socket) and :mod:`~envfleet.backends.ray.call_path` (Ray calls);
- :mod:`~envfleet.backends.ray.actor`: the actor, and :mod:`~envfleet.backends.ray.worker_actor`
  the pool's handle on one;
- :mod:`~envfleet.backends.ray.session`: which Ray a pool runs on, and when it is let go of;
- :mod:`~envfleet.backends.ray.options`: :class:`~envfleet.backends.ray.options.RayOptions`,
  the backend's own options (importing it does not import Ray);
- :mod:`~envfleet.backends.ray.memory`: the batch memory shared with the actors of the pool's
  own machine;
- :mod:`~envfleet.backends.ray.ended`: whether the processes Ray ends for a pool have ended,
  and waiting for them (no Ray imported).

These import the contract, never the node sub-pools;
whether a ``backend="ray"`` pool runs one actor per worker or node sub-pools is
:mod:`envfleet.backends.ray_backend`'s choice. This ``__init__`` imports nothing, so that the
options are read without starting Ray.
"""

__all__: list[str] = []
