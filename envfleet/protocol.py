"""The messages between the pool and the env groups it drives, whatever the transport.

A command is a small frozen dataclass that knows which :class:`~envfleet.group.EnvGroup` method
serves it (``command.run(group)``), so workers dispatch without an ``if``/``elif`` chain on
strings; a :class:`Sample`'s loop is :func:`envfleet.rollout_loop.sample`, which the worker runs
(:func:`envfleet.worker.run_command`), so that this module imports none of the group's. Every
command gets exactly one :class:`Reply`, in order, per worker.

The commands are a closed set of two kinds, told apart by type (never by a flag):

- an :class:`EnvCommand` (:class:`Step`, :class:`Reset`) *delivers envs*: it names
  ``env_ids``, and once its reply is in, those envs' rows are in the batch arrays (the
  transport's job, see :mod:`envfleet.backends.contract.base`) and they are ready for ``recv``;
- a :class:`ValueCommand` (:class:`Call`, :class:`SetAttr`, :class:`Sample`) *returns values*:
  its reply carries one value per env (:class:`Sample`: one for the worker), which the pool
  matches to the very command object it sent (these compare and hash by identity);
- :class:`Close` ends a worker.

Each type names its :class:`~envfleet.errors.Phase` as a class attribute (``Step.phase``).
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet.errors import EnvError, Phase, RemoteError, RemoteTraceback, env_raised_error
from envfleet.shared_records import RecordRef
from envfleet.weight_frames import SegmentRef

if TYPE_CHECKING:
    from envfleet.buffers import Batch


class Group(Protocol):
    """What serves commands: an :class:`~envfleet.group.EnvGroup` or a threaded set of them."""

    @property
    def batch(self) -> Batch: ...
    @property
    def mode(self) -> AutoresetMode: ...
    @property
    def observation_space(self) -> gymnasium.Space[Any]: ...
    @property
    def action_space(self) -> gymnasium.Space[Any]: ...

    def reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> Reply: ...

    def step(self, env_ids: Sequence[int], actions: dict[int, Any] | None = None) -> Reply: ...

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply: ...

    def set_attr(self, name: str, values: dict[int, Any]) -> Reply: ...

    def close(self) -> Reply: ...


@dataclass(frozen=True)
class EnvFailure:
    """An exception raised by one env, in a form that crosses any transport."""

    env_index: int | None
    phase: Phase
    type_name: str
    message: str
    traceback: str
    exception: bytes | None  # cloudpickled original, when it survives a round trip

    @classmethod
    def capture(cls, env_index: int | None, phase: Phase, exc: BaseException) -> EnvFailure:
        """Record ``exc`` (call from inside the ``except`` block).

        Never raises, whatever ``exc`` does: a ``__str__`` that raises, an exception that
        cannot be pickled, or one that cannot be rebuilt all still give a record of this env.
        """
        type_name = _safe(lambda: type(exc).__qualname__, "BaseException")
        message = _safe(lambda: str(exc), f"<{type_name}: str() raised>")
        text = _safe(
            lambda: "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            f"{type_name}: {message} (its traceback could not be formatted)\n",
        )
        try:
            data: bytes = cloudpickle.dumps(exc)
            rebuilt = pickle.loads(data)  # custom __init__ signatures fail only here
            str(rebuilt)  # the parent formats it; a broken __str__ travels as text instead
            blob: bytes | None = data
        except BaseException:
            blob = None
        return cls(env_index, phase, type_name, message, text, blob)

    @classmethod
    def capture_all(
        cls, env_ids: Sequence[int], phase: Phase, exc: BaseException
    ) -> list[EnvFailure]:
        """:meth:`capture` for envs that fail together (a hosted VectorEnv's block): the same
        failure for each of ``env_ids``, the first named first, so that none of them counts
        as delivered."""
        first = cls.capture(env_ids[0], phase, exc)
        return [first, *(dataclasses.replace(first, env_index=i) for i in env_ids[1:])]

    def original(self) -> BaseException:
        """The original exception rebuilt (or a :class:`RemoteError` with its text)."""
        exc: BaseException | None = None
        if self.exception is not None:
            try:
                exc = pickle.loads(self.exception)
            except Exception:
                exc = None
        if exc is None:
            exc = RemoteError(self.type_name, self.message)
        exc.__cause__ = RemoteTraceback(self.traceback)
        return exc

    def to_error(self, worker: int, env_name: str) -> EnvError:
        """The error the pool raises, naming env, phase and worker; the original is its cause."""
        where = f"env {self.env_index}" if self.env_index is not None else "a worker"
        return env_raised_error(
            f"{where} ({env_name}, worker {worker}) raised {self.type_name} during "
            f"{self.phase.value}: {self.message}",
            self.original(),
            env_index=self.env_index,
            phase=self.phase,
            worker=worker,
        )


def _safe(get: Any, fallback: str) -> str:
    try:
        return str(get())
    except BaseException:
        return fallback


@dataclass
class Rows:
    """Result rows of some envs, shipped back by a worker whose rows the pool cannot read where
    they were written (a remote Ray actor; observations of a space shared memory cannot hold).

    They never reach the pool: the transport writes them into its batch before ``wait``
    returns (:mod:`envfleet.backends.contract.rows`).
    """

    env_ids: np.ndarray
    observations: Any  # a batch laid out like the pool's (or a list, pickled path)
    rewards: np.ndarray | None = None  # None: these fields are in shared memory already
    terminations: np.ndarray | None = None
    truncations: np.ndarray | None = None


@dataclass
class Reply:
    """What a group sends back for one command."""

    env_ids: tuple[int, ...] = ()
    infos: Mapping[int, dict[str, Any]] | None = None  # only the non-empty ones
    rows: Rows | None = None  # the results themselves, when the transport ships them
    values: dict[int, Any] | None = None  # results of call/get_attr, per env
    failures: tuple[EnvFailure, ...] = ()
    restarts: tuple[EnvFailure, ...] = ()  # failures the group recovered from by a restart
    kept: tuple[int, ...] = ()
    """Envs whose observation row the command left as it was (a restarted env's interrupted
    episode, reported truncated: its latest observation stands); rows shipped for them do not
    overwrite the pool's."""


class EnvCommand:
    """A command that delivers envs: their results land in the batch, they become ready."""

    env_ids: tuple[int, ...]
    phase: ClassVar[Phase]

    def run(self, group: Group) -> Reply:
        raise NotImplementedError


@dataclass(frozen=True)
class Reset(EnvCommand):
    """Reset ``env_ids`` with one seed each; their results land in the batch arrays."""

    env_ids: tuple[int, ...]
    seeds: tuple[int | None, ...]
    options: dict[str, Any] | None = None
    phase: ClassVar[Phase] = Phase.RESET

    def run(self, group: Group) -> Reply:
        return group.reset(self.env_ids, self.seeds, self.options)


@dataclass(frozen=True)
class Step(EnvCommand):
    """Step ``env_ids`` with the actions already in the batch (or carried, pickled path)."""

    env_ids: tuple[int, ...]
    actions: dict[int, Any] | None = None
    phase: ClassVar[Phase] = Phase.STEP

    def run(self, group: Group) -> Reply:
        return group.step(self.env_ids, self.actions)


class ValueCommand:
    """A command that returns one value per env (its reply's ``values``).

    Compared and hashed by identity (``eq=False``): the pool files each reply under the command
    object it sent.
    """

    phase: ClassVar[Phase] = Phase.CALL

    def run(self, group: Group) -> Reply:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Call(ValueCommand):
    """Call a method (or read an attribute) on every env of the group."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self, group: Group) -> Reply:
        return group.call(self.name, self.args, self.kwargs)


@dataclass(frozen=True, eq=False)
class SetAttr(ValueCommand):
    """Set an attribute on each env of the group, one value per env."""

    name: str
    values: dict[int, Any]

    def run(self, group: Group) -> Reply:
        return group.set_attr(self.name, self.values)


@dataclass(frozen=True, eq=False)
class Sample(ValueCommand):
    """Step ``env_ids`` ``steps`` times in a row with a policy run on the worker
    (:meth:`envfleet.Pool.rollout`), as that many :class:`Step` s would: the loop is
    :func:`envfleet.rollout_loop.sample`, which the worker runs
    (:func:`envfleet.worker.run_command`: a rollout is a loop, not one method of the group). Its
    reply's ``values`` hold one :class:`~envfleet.rollout_loop.Sampled` under the first of
    ``env_ids``."""

    env_ids: tuple[int, ...]
    steps: int
    policy: bytes | SegmentRef | None
    """Pickled as cloudpickle would (inline, or where it is in the machine's shared memory);
    ``None``: the copy the worker keeps."""
    check_actions: bool = False
    version: int = 0
    """The version of the policy's weights that acts (stamped on every step recorded)."""
    code: str = ""
    """A digest of ``policy``'s bytes: the worker keeps the policy under it, so that a later
    command may carry no code (``policy=None``), only new ``weights``."""
    weights: bytes | SegmentRef | None = None
    """``policy.weights()`` of ``version`` as a frame (:mod:`envfleet.weight_frames`), for
    ``policy.load_weights``: inline, or where it is in the machine's shared memory; ``None``:
    the worker has them (or the policy has no weights apart from its code)."""
    record: RecordRef | None = None
    """Where to record the part: its columns of the rollout's arrays in the pool's shared
    memory (:mod:`envfleet.shared_records`); ``None``: recorded in the worker's own, and sent."""
    phase: ClassVar[Phase] = Phase.STEP


@dataclass(frozen=True)
class Close:
    """Close every env of the group; the worker exits after replying."""

    phase: ClassVar[Phase] = Phase.CLOSE

    def run(self, group: Group) -> Reply:
        return group.close()


Command = Reset | Step | Call | SetAttr | Sample | Close


__all__ = [
    "Call",
    "Close",
    "Command",
    "EnvCommand",
    "EnvFailure",
    "Group",
    "Reply",
    "Reset",
    "Rows",
    "Sample",
    "SetAttr",
    "Step",
    "ValueCommand",
]
