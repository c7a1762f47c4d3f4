"""The Ray backend: one actor per worker, each stepping several envs per remote call.

The naive pattern (an actor per env, a remote call per env step) pays Ray's per-call cost on
every env step; here one ``run.remote(Step(ids))`` steps all of an actor's envs and returns
their rows packed in arrays, calls stay in flight on every actor at once, and ``ray.wait``
hands back whichever actors finish first (the async mode). Results larger than Ray returns
inline (images) travel in pieces that it does (:meth:`GroupActor.run_chunked`). A dead actor or
node surfaces as a :class:`~envfleet.backends.base.WorkerLost`, like a dead process; an actor
that dies before it has built its envs (placed on a node that just died) is replaced.

Connections: a pool joins the Ray this process is already connected to, and then leaves it
alone. Otherwise it calls ``ray.init`` itself (a new local Ray sized for this machine with no
address, or the cluster at ``address``), and the last pool on that connection to close calls
``ray.shutdown``: that stops a Ray envfleet started, and only disconnects from a cluster it
joined (which keeps running).

Ray is an optional extra (``pip install envfleet[ray]``): this module alone imports it.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import cloudpickle
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from envfleet.backends.base import TransportOptions, WorkerLost
from envfleet.buffers import Batch, ObjectRows, take
from envfleet.errors import Phase, WorkerDiedError
from envfleet.group import GroupStartError
from envfleet.protocol import Close, Command, EnvFailure, Reply, Reset, Rows, Step
from envfleet.worker import build_group

START_TIMEOUT = 300.0
"""Seconds an actor may take to be placed and build its envs before the pool gives up on it
(an actor asking for resources no node has would otherwise wait forever)."""

START_ATTEMPTS = 5
START_BACKOFF = 0.5
"""An actor that dies before it has built its envs is replaced, up to this many actors in all,
``START_BACKOFF`` seconds later and twice as long each time (about 8 s in all)."""

Packed = tuple[
    np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray, "dict[int, dict[str, Any]] | None"
]
"""A step's or reset's reply with nothing but results: ``(env_ids, observations, rewards,
terminations, truncations, infos)``, rows in ``env_ids`` order."""

CHUNK_BYTES = 90 * 1024
"""Results of a step or reset expected to be larger travel in pieces of about this size (under
Ray's 100 KiB limit for results returned inline), see :meth:`GroupActor.run_chunked`."""

_lock = threading.Lock()
_session: str | None = None  # the Ray connection envfleet made (see _session_id), if any
_users = 0  # open transports on that connection


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

    def run(self, command: Command) -> Reply | Packed:
        reply = command.run(self.group)
        if reply.infos or reply.values:
            # Ray pickles the reply after this returns, where a failure would lose the rows.
            try:
                cloudpickle.dumps((reply.infos, reply.values))
            except Exception as exc:
                reply = Reply(
                    env_ids=reply.env_ids,
                    failures=(*reply.failures, _unpicklable(exc)),
                    restarts=reply.restarts,
                )
        if not (command.delivers_envs and reply.env_ids):
            return reply
        failed = {f.env_index for f in reply.failures}
        ids = np.array([i for i in reply.env_ids if i not in failed], dtype=np.intp)
        batch = self.batch
        observations = batch.observations
        rows = Rows(
            env_ids=ids,
            # Spaces that are not arrays travel as a list of per-env values.
            observations=[observations[i] for i in ids.tolist()]
            if isinstance(observations, ObjectRows)
            else take(self.options.observation_space, observations, ids),
            rewards=batch.rewards[ids],
            terminations=batch.terminations[ids],
            truncations=batch.truncations[ids],
        )
        if reply.failures or reply.restarts or reply.observations:
            reply.rows = rows
            return reply
        # The common case travels as a tuple: Ray pickles it faster than the dataclasses.
        return (
            ids,
            rows.observations,
            rows.rewards,
            rows.terminations,
            rows.truncations,
            reply.infos,
        )

    def run_chunked(self, command: Command, chunks: int) -> tuple[bytes, ...]:
        """:meth:`run`, its result pickled and cut in ``chunks`` pieces for Ray to return.

        Ray returns a result under 100 KiB inline, in the reply to the call, and a larger one
        through its object store, which costs a round trip through the raylet on each side
        (about 40% of the time of a step of 8 Pong envs over 2 actors, on 2 cores here). The
        observations of a few images are larger: in pieces under that size, they travel inline.
        """
        data = cloudpickle.dumps(self.run(command), protocol=5)
        size = -(-len(data) // chunks)
        return tuple(data[k * size : (k + 1) * size] for k in range(chunks))


def _unpack(result: Reply | Packed) -> Reply:
    """The :class:`Reply` an actor's :meth:`GroupActor.run` result stands for."""
    if isinstance(result, Reply):
        return result
    ids, observations, rewards, terminations, truncations, infos = result
    rows = Rows(ids, observations, rewards, terminations, truncations)
    return Reply(env_ids=tuple(ids.tolist()), infos=infos, rows=rows)


def _unpicklable(exc: Exception) -> EnvFailure:
    try:
        raise TypeError(f"the reply could not be pickled to send to the pool: {exc}") from exc
    except TypeError as error:
        return EnvFailure.capture(None, Phase.STEP, error)


def _session_id() -> str:
    """What identifies the Ray this process is connected to (its GCS address)."""
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection may not say
        return "connected"


def _connect(address: str | None, init_kwargs: dict[str, Any]) -> bool:
    """Join this process's Ray, or connect it to one; True when envfleet owns the connection."""
    global _session, _users
    with _lock:
        if ray.is_initialized():
            if _session is not None and _session == _session_id():
                _users += 1
                return True
            return False  # the caller's connection: used, never shut down
        kwargs = dict(init_kwargs)
        if address is not None:
            kwargs["address"] = address
        if not str(kwargs.get("address") or "").startswith("ray://"):  # Ray Client takes few
            kwargs = {"include_dashboard": False, "log_to_driver": False, **kwargs}
        ray.init(**kwargs)
        _session, _users = _session_id(), 1
        return True


def _disconnect() -> None:
    """One transport on envfleet's connection is done; the last one shuts it down."""
    global _session, _users
    with _lock:
        if _session is None:
            return
        _users -= 1
        if _users > 0:
            return
        session, _session, _users = _session, None, 0
        # Not if the caller shut it down and connected again meanwhile: that one is theirs.
        if ray.is_initialized() and _session_id() == session:
            ray.shutdown()


_PHASES = {Step: Phase.STEP, Reset: Phase.RESET}


def _row_bytes(batch: Batch, num_envs: int) -> int | None:
    """Bytes of one env's results (``None`` when observations are not arrays)."""
    if isinstance(batch.observations, ObjectRows):
        return None
    leaves = [batch.observations, batch.rewards, batch.terminations, batch.truncations]
    total = 0
    while leaves:
        leaf = leaves.pop()
        if isinstance(leaf, dict):
            leaves.extend(leaf.values())
        elif isinstance(leaf, tuple):
            leaves.extend(leaf)
        else:
            total += leaf.nbytes
    return -(-total // num_envs)


class RayTransport:
    """One actor per worker; replies come back per actor, in order, through ``ray.wait``."""

    shares_memory = False

    def __init__(self, options: TransportOptions) -> None:
        extra = options.ray or {}
        self._options = options
        self.batch = Batch.local(options.observation_space, options.action_space, options.num_envs)
        self._actors: list[Any] = []
        # Per worker: (result refs, command) of each call in flight, oldest first; the refs are
        # the pieces of one result (one ref unless the result travels in pieces).
        self._refs: list[deque[tuple[list[Any], Command]]] = [deque() for _ in options.assignment]
        self._row_bytes = _row_bytes(self.batch, options.num_envs)
        self._closed = False
        self._connected = _connect(extra.get("address"), dict(extra.get("init_kwargs") or {}))
        try:
            self._actor_cls = ray.remote(GroupActor)
            resources = dict(extra.get("worker_resources") or {})
            resources.setdefault("num_cpus", 0)
            if "placement_group" not in resources:
                resources.setdefault("scheduling_strategy", "SPREAD")
            self._resources = resources
            for worker in range(len(options.assignment)):
                self._actors.append(self._spawn(worker, {}))
            self._await_start(range(len(self._actors)), {})
        except BaseException:
            self.close(1.0)
            raise

    def _spawn(self, worker: int, restarts: dict[int, int]) -> Any:
        return self._actor_cls.options(max_concurrency=1, max_restarts=0, **self._resources).remote(
            self._options, worker, restarts
        )

    def _await_start(self, workers: Iterable[int], restarts: dict[int, int]) -> None:
        """Wait until each of ``workers`` has built its envs; raise the first failure.

        An actor that dies before it has built them (its worker process or its node died, say
        a node that Ray does not know dead yet) is replaced, up to ``START_ATTEMPTS`` times.
        """
        started = [(worker, self._actors[worker].start.remote()) for worker in workers]
        deadline = time.monotonic() + START_TIMEOUT
        for worker, ref in started:
            ids = tuple(self._options.assignment[worker])
            delay = START_BACKOFF
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    reply: Reply = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                    break
                except GetTimeoutError as exc:
                    raise WorkerDiedError(
                        f"ray actor {worker} (envs {list(ids)}) did not start within "
                        f"{START_TIMEOUT:g}s: is there a node with the resources it asks for "
                        f"({self._resources})?",
                        env_index=None,
                        phase=Phase.MAKE,
                        worker=worker,
                        env_ids=ids,
                    ) from exc
                except RayError as exc:
                    if attempt == START_ATTEMPTS:
                        raise WorkerDiedError(
                            f"ray actor {worker} died while building its envs {list(ids)} "
                            f"({attempt} actors in a row): {exc}",
                            env_index=None,
                            phase=Phase.MAKE,
                            worker=worker,
                            env_ids=ids,
                        ) from exc
                    time.sleep(delay)
                    delay *= 2
                    self._actors[worker] = self._spawn(worker, restarts)
                    ref = self._actors[worker].start.remote()
            if reply.failures:
                raise reply.failures[0].to_error(worker, self._options.spec.name)

    def node_ids(self) -> list[str]:
        """The Ray node each actor runs on."""
        return list(ray.get([actor.node_id.remote() for actor in self._actors]))

    def submit(self, worker: int, command: Command) -> None:
        actor = self._actors[worker]
        chunks = 1
        if command.delivers_envs and self._row_bytes is not None:
            size = len(command.env_ids) * self._row_bytes  # type: ignore[union-attr]
            chunks = -(-size // CHUNK_BYTES)
        if chunks > 1:
            refs = actor.run_chunked.options(num_returns=chunks).remote(command, chunks)
        else:
            refs = [actor.run.remote(command)]
        self._refs[worker].append((refs, command))

    def wait(
        self, timeout: float | None, want: int = 1
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        heads = [refs[0][0][-1] for refs in self._refs if refs]
        if not heads:
            return []
        ready, _ = ray.wait(heads, num_returns=1, timeout=timeout)
        if not ready:
            return []
        # Everything else already done comes too, without waiting.
        pending = [ref for refs in self._refs for pieces, _ in refs for ref in pieces]
        done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) | set(ready)
        replies: list[tuple[int, Reply | WorkerLost | None]] = []
        for worker, refs in enumerate(self._refs):
            while refs and refs[0][0][-1] in done:  # the pieces of a result come together
                pieces, command = refs.popleft()
                try:
                    values = ray.get(pieces)
                    result = values[0] if len(values) == 1 else pickle.loads(b"".join(values))
                    replies.append((worker, _unpack(result)))
                except RayTaskError as exc:  # the actor lives but the call failed (a bug)
                    replies.append((worker, _task_failed(command, exc)))
                except RayError as exc:  # actor, worker process or node died; result lost
                    refs.clear()
                    replies.append((worker, WorkerLost(None, f"ray actor lost: {exc}")))
        return replies

    def kill(self, worker: int) -> None:
        try:
            ray.kill(self._actors[worker], no_restart=True)
        except Exception:
            pass  # already gone: wait() reports it lost all the same

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.kill(worker)
        self._refs[worker].clear()
        self._actors[worker] = self._spawn(worker, restarts)
        self._await_start([worker], restarts)

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._actors and ray.is_initialized():
                closing = []
                for actor in self._actors:
                    try:
                        closing.append(actor.run.remote(Close()))
                    except Exception:
                        pass
                try:
                    if closing:
                        ray.wait(closing, num_returns=len(closing), timeout=timeout)
                except Exception:
                    pass  # a dead actor or node: killed below all the same
                for actor in self._actors:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:
                        pass
        finally:
            self._actors = []
            for refs in self._refs:
                refs.clear()
            if self._connected:
                self._connected = False
                _disconnect()


def _task_failed(command: Command, exc: RayTaskError) -> Reply:
    """The reply to a call the actor could not run: every env it named failed."""
    phase = _PHASES.get(type(command), Phase.CALL)
    if command.delivers_envs:
        ids: tuple[int, ...] = command.env_ids  # type: ignore[union-attr]
        return Reply(env_ids=ids, failures=tuple(EnvFailure.capture(i, phase, exc) for i in ids))
    return Reply(failures=(EnvFailure.capture(None, phase, exc),))


def open_transport(options: TransportOptions) -> RayTransport:
    return RayTransport(options)
