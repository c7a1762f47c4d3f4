"""What a worker's reply says, whatever the wire: whether it is plain (nothing to report beyond
success), its infos as columns when they are all it carries, the failures that stand in for a
reply or a command that cannot cross, and commands pickled once each on the pool's side."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

from envfleet.errors import Phase
from envfleet.info_columns import Columns, info_columns
from envfleet.protocol import Command, EnvFailure, Reply

__all__ = ["PickledCommands", "as_columns", "beyond_infos", "plain", "undecodable", "unpicklable"]


def plain(reply: Reply) -> bool:
    """Nothing to report beyond success: the pool knows which envs the command named, and
    their rows are where it reads them (such a reply travels as ``None``, or one byte)."""
    return not reply.infos and not beyond_infos(reply)


def as_columns(reply: Reply) -> Columns | None:
    """The reply's infos as columns when it reports nothing else and they are all plain
    scalars (:func:`~envfleet.info_columns.info_columns`); ``None`` when it must travel whole."""
    if reply.infos and not beyond_infos(reply):
        return info_columns(reply.infos)
    return None


def beyond_infos(reply: Reply) -> bool:
    """Whether ``reply`` reports anything but infos: failures, restarts, rows, call results or
    rows left as they were (those always come with a restarted env's infos)."""
    return bool(reply.failures or reply.restarts or reply.rows or reply.values or reply.kept)


def unpicklable(reply: Reply, exc: Exception) -> EnvFailure:
    """The failure that replaces a reply that cannot be pickled (naming its first env)."""
    try:
        raise TypeError(f"the reply could not be pickled to send to the pool: {exc}") from exc
    except TypeError as error:
        env = reply.env_ids[0] if reply.env_ids else None
        return EnvFailure.capture(env, Phase.STEP, error)


def undecodable(exc: Exception) -> Reply:
    """The reply to a command this worker could not unpickle: it pickled in the pool, but
    something in it cannot be rebuilt here (a class this process cannot import, a
    ``__reduce__`` that fails). The command failed as a whole, and the worker serves on."""
    try:
        raise TypeError(
            "the worker could not unpickle the command the pool sent it: an argument pickled "
            "in the pool cannot be rebuilt in the worker (see the cause)"
        ) from exc
    except TypeError as error:
        return Reply(failures=(EnvFailure.capture(None, Phase.CALL, error),))


class PickledCommands:
    """Commands pickled once each: the pool sends the same step-every-env commands every step."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Command, bytes]] = {}

    def dumps(self, command: Command) -> bytes:
        cached = self._cache.get(id(command))
        if cached is None or cached[0] is not command:
            if len(self._cache) > 256:
                self._cache.clear()
            cached = (command, bytes(ForkingPickler.dumps(command)))
            self._cache[id(command)] = cached
        return cached[1]
