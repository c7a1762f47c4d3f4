"""The backends of one machine: ``serial``, ``thread`` and ``process``.

- :mod:`~envfleet.backends.local.serial`, :mod:`~envfleet.backends.local.thread`: the envs in
  the caller's process;
- :mod:`~envfleet.backends.local.process`: worker processes over shared memory (also the pool
  a node's agent runs, as a :class:`~envfleet.backends.contract.base.LocalPool`), with
  :mod:`~envfleet.backends.local.worker_process` (what runs in a worker process and the pool's
  handle on one), :mod:`~envfleet.backends.local.shm` (the shared memory),
  :mod:`~envfleet.backends.local.wake_order` (the order a step's commands go out in),
  :mod:`~envfleet.backends.local.spin` (when a wait polls before it sleeps),
  :mod:`~envfleet.backends.local.workers` (waiting for the workers to build their envs and to
  exit),
  :mod:`~envfleet.backends.local.lifeline` (a worker dies with its parent) and
  :mod:`~envfleet.backends.local.runnable` (is the machine busy).

These import the contract only.
"""

__all__: list[str] = []
