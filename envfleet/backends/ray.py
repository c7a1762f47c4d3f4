"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). A dead actor or node surfaces as a
:class:`~envfleet.backends.base.WorkerLost`, like a dead process.

Ray is an optional extra (``pip install envfleet[ray]``): this module alone imports it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.buffers import Batch, take
from envfleet.errors import Phase
from envfleet.group import GroupStartError
from envfleet.protocol import Close, Command, EnvFailure, Reply, Rows
from envfleet.threads import build_group

_lock = threading.Lock()
_started_here = False  # whether envfleet called ray.init (and so may shut it down)
_users = 0  # open pools on a Ray that envfleet started


class GroupActor:
    """The actor: one group of envs, and arrays of the pool's shape that only it fills.

    The arrays are ``np.zeros`` of the full pool size, but only this actor's rows are ever
    touched, and untouched zero pages cost no memory.
    """

    def __init__(self, options: TransportOptions, worker: int, restarts: dict[int, int]) -> None:
        self.options = options
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self.failure: EnvFailure | None = None
        try:
            self.group = build_group(
                options, options.assignment[worker], self.batch, restarts=restarts
            )
        except GroupStartError as exc:
            self.failure = exc.failure
        except Exception as exc:
            self.failure = EnvFailure.capture(None, Phase.MAKE, exc)

    def start(self) -> Reply:
        return Reply(failures=(self.failure,) if self.failure else ())

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def run(self, command: Command) -> Reply:
        reply = command.run(self.group)
        if command.delivers_envs and reply.env_ids:
            failed = {f.env_index for f in reply.failures}
            ids = np.array([i for i in reply.env_ids if i not in failed], dtype=np.intp)
            batch = self.batch
            reply.rows = Rows(
                env_ids=ids,
                observations=take(self.options.observation_space, batch.observations, ids),
                rewards=batch.rewards[ids],
                terminations=batch.terminations[ids],
                truncations=batch.truncations[ids],
            )
        return reply


def _connect(address: str | None, init_kwargs: dict[str, Any]) -> bool:
    """Join or start Ray; True when this call started it."""
    global _started_here, _users
    with _lock:
        if ray.is_initialized():
            if _started_here:
                _users += 1
            return False
        kwargs = {"include_dashboard": False, "log_to_driver": False, **init_kwargs}
        if address is not None:
            ray.init(address=address, **kwargs)
            return False
        ray.init(**kwargs)
        _started_here, _users = True, 1
        return True


def _disconnect() -> None:
    global _started_here, _users
    with _lock:
        if not _started_here:
            return
        _users -= 1
        if _users <= 0 and ray.is_initialized():
            ray.shutdown()
            _started_here, _users = False, 0


class RayTransport:
    """One actor per worker; replies come back per actor, in order, through ``ray.wait``."""

    def __init__(self, options: TransportOptions) -> None:
        extra = options.ray or {}
        self._options = options
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        _connect(extra.get("address"), dict(extra.get("init_kwargs") or {}))
        self._uses_our_ray = _started_here
        self._actor_cls = ray.remote(GroupActor)
        resources = dict(extra.get("worker_resources") or {})
        resources.setdefault("num_cpus", 0)
        resources.setdefault("scheduling_strategy", "SPREAD")
        self._resources = resources
        self._actors: list[Any] = []
        self._refs: list[deque[Any]] = [deque() for _ in options.assignment]
        self._closed = False
        try:
            self._actors = [self._spawn(w, {}) for w in range(len(options.assignment))]
            self._await_start(range(len(self._actors)))
        except BaseException:
            self.close(1.0)
            raise

    def _spawn(self, worker: int, restarts: dict[int, int]) -> Any:
        return self._actor_cls.options(
            name=None, max_concurrency=1, max_restarts=0, **self._resources
        ).remote(self._options, worker, restarts)

    def _await_start(self, workers: Any) -> None:
        for worker in workers:
            try:
                reply: Reply = ray.get(self._actors[worker].start.remote())
            except RayActorError as exc:
                from envfleet.errors import WorkerDiedError

                raise WorkerDiedError(
                    f"ray actor {worker} died while building its envs: {exc}",
                    env_index=None,
                    phase=Phase.MAKE,
                    worker=worker,
                ) from exc
            if reply.failures:
                raise reply.failures[0].to_error(worker, self._options.spec.name)

    def node_ids(self) -> list[str]:
        """The Ray node each actor runs on."""
        return list(ray.get([actor.node_id.remote() for actor in self._actors]))

    shares_memory = False

    def submit(self, worker: int, command: Command) -> None:
        self._refs[worker].append(self._actors[worker].run.remote(command))

    def wait(self, timeout: float | None) -> list[tuple[int, Reply | WorkerLost | None]]:
        heads = [refs[0] for refs in self._refs if refs]
        if not heads:
            return []
        ready, _ = ray.wait(heads, num_returns=1, timeout=timeout)
        if not ready:
            return []
        # Everything else already done comes too, without waiting.
        pending = [ref for refs in self._refs for ref in refs]
        done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) | set(ready)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, refs in enumerate(self._refs):
            while refs and refs[0] in done:
                ref = refs.popleft()
                try:
                    replies.append((worker, ray.get(ref)))
                except RayActorError as exc:
                    refs.clear()
                    replies.append((worker, WorkerLost(None, f"ray actor lost: {exc}")))
                except RayTaskError as exc:
                    failure = EnvFailure.capture(None, Phase.STEP, exc)
                    replies.append((worker, Reply(failures=(failure,))))
        return replies

    def kill(self, worker: int) -> None:
        ray.kill(self._actors[worker], no_restart=True)

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        try:
            ray.kill(self._actors[worker], no_restart=True)
        except Exception:
            pass
        self._refs[worker].clear()
        self._actors[worker] = self._spawn(worker, restarts)
        self._await_start([worker])

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            closing = [actor.run.remote(Close()) for actor in self._actors]
            try:
                ray.wait(closing, num_returns=len(closing), timeout=timeout)
            except (RayActorError, GetTimeoutError):
                pass
            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
        finally:
            self._actors = []
            if self._uses_our_ray:
                _disconnect()


def open_transport(options: TransportOptions) -> RayTransport:
    return RayTransport(options)
