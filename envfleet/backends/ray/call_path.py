"""The Ray backend's call path: commands to an actor as Ray calls, their results back.

An actor on another machine (or any actor, over a Ray Client connection) takes each command as
``run.remote(command)``, a step's actions carried in it (the actor does not see the pool's
batch). Its result comes back as arrays packed by the actor; a result larger than Ray returns
inline (images) travels in pieces that it does (:data:`CHUNK_BYTES`,
:meth:`~envfleet.backends.ray.actor.GroupActor.run_chunked`). :func:`wait_calls` hands back the
replies of whichever actors finished first, their rows delivered into the batch; a dead actor or
node is a :class:`~envfleet.backends.contract.base.WorkerLost`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
import ray
from ray.exceptions import RayError, RayTaskError

from envfleet.backends.contract.base import WorkerLost
from envfleet.backends.contract.rows import deliver
from envfleet.backends.ray.actor import unpack
from envfleet.backends.ray.worker_actor import ActorSlot
from envfleet.buffers import Batch
from envfleet.protocol import Command, EnvCommand, EnvFailure, Reply, Step

__all__ = ["CHUNK_BYTES", "submit_call", "wait_calls"]

CHUNK_BYTES = 90 * 1024
"""Results of a step or reset expected to be larger travel in pieces of about this size (under
Ray's 100 KiB limit for results returned inline), see
:meth:`~envfleet.backends.ray.actor.GroupActor.run_chunked`."""


def submit_call(
    slot: ActorSlot,
    command: Command,
    read_action: Callable[[int], Any] | None,
    row_bytes: int | None,
) -> None:
    """Send ``command`` to ``slot``'s actor as a Ray call: a step's actions read from the batch
    with ``read_action`` when the pool wrote them there; in pieces when its rows (``row_bytes``
    an env) come to more than :data:`CHUNK_BYTES`."""
    if isinstance(command, Step) and command.actions is None and read_action:
        # The pool wrote the actions to the batch, which this actor does not see.
        command = Step(command.env_ids, {i: read_action(i) for i in command.env_ids})
    actor = slot.handle
    chunks = 1
    if isinstance(command, EnvCommand) and row_bytes is not None:
        size = len(command.env_ids) * row_bytes
        chunks = -(-size // CHUNK_BYTES)
    if chunks > 1:
        refs = actor.run_chunked.options(num_returns=chunks).remote(command, chunks)
    else:
        refs = [actor.run.remote(command)]
    slot.refs.append((refs, command))


def wait_calls(
    workers: Sequence[ActorSlot], timeout: float | None, batch: Batch, space: gymnasium.Space[Any]
) -> list[tuple[int, Reply | WorkerLost | None]]:
    """The replies of the calls done within ``timeout`` (the first to finish, and every other
    already done), oldest first per actor, their rows delivered into ``batch``."""
    heads = [slot.refs[0][0][-1] for slot in workers if slot.refs]
    if not heads:
        return []
    ready, _ = ray.wait(heads, num_returns=1, timeout=timeout)
    if not ready:
        return []
    # Everything else already done comes too, without waiting.
    pending = [ref for slot in workers for pieces, _ in slot.refs for ref in pieces]
    done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) | set(ready)
    replies: list[tuple[int, Reply | WorkerLost | None]] = []
    for worker, slot in enumerate(workers):
        refs = slot.refs
        while refs and refs[0][0][-1] in done:  # the pieces of a result come together
            pieces, command = refs.popleft()
            try:
                values = ray.get(pieces)
                result = values[0] if len(values) == 1 else pickle.loads(b"".join(values))
                reply = unpack(result)  # the rows travelled back: into the batch
                replies.append((worker, deliver(batch, space, reply)))
            except RayTaskError as exc:  # the actor lives but the call failed (a bug)
                replies.append((worker, _task_failed(command, exc)))
            except RayError as exc:  # actor, worker process or node died; result lost
                refs.clear()
                replies.append((worker, WorkerLost(None, f"ray actor lost: {exc}")))
    return replies


def _task_failed(command: Command, exc: RayTaskError) -> Reply:
    """The reply to a call the actor could not run: every env it named failed."""
    phase = command.phase
    if isinstance(command, EnvCommand):
        ids = command.env_ids
        return Reply(env_ids=ids, failures=tuple(EnvFailure.capture(i, phase, exc) for i in ids))
    return Reply(failures=(EnvFailure.capture(None, phase, exc),))
