"""The process backend's transport: worker processes, each version's weights shared, each
rollout's part recorded where the pool (or a node's agent) reads it.

A rollout's :class:`~envfleet.protocol.Sample` carries a version's weights (a frame of
:mod:`envfleet.weight_frames`) to the workers that lack it. Sent as they come, a pipe per
worker would carry the frame once per worker. Here the pool's side of the machine (the pool's
process, or a node's agent for its node) writes each version once into a segment of shared
memory and each worker's command carries only where it is::

    submit(Sample(weights=frame)) ── the frame's segment (written once per version) ──►
        Sample(weights=SegmentRef(pid, fd, size, digest, version)) down the worker's pipe
    worker: maps the segment copy-on-write (rollout_loop: weight_frames.load)

A policy's code travels once per worker (the first rollout, a rebuilt worker), pickled whole
with the weights its object holds then: when it is large, it goes through a segment as well,
so that no command is larger than a pipe holds (a pipe has room for 64 KiB: a larger command
would wait in the pool until its next wait, and ``rollout_async`` would return before its
workers could start).

A segment stays while a command that names it is unanswered (its worker may not have read it
yet) or while its version is the newest sent; then it is closed. A worker lost or replaced owes
nothing more; the pool's close closes them all. Segments are memfds, named nowhere: one the
pool (or an agent) still held when it was killed goes with its process and its workers.

A rollout's part goes the same way: where the pool gives its columns in shared memory
(:meth:`SharedWeightsTransport.land`), the worker's command names them
(:mod:`envfleet.shared_records`) and the worker records its steps there, so no pipe carries
them; else the part is read from the worker's pipe into them.

:class:`SharedWeightsTransport` is :class:`~envfleet.backends.local.process.ProcessTransport`
with :class:`Segments` (and the parts' columns) on its way in and out; everything else is the
process backend's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import deque
from collections.abc import Callable

from envfleet.backends.contract.base import LocalPool, Replies, TransportOptions, WorkerLost
from envfleet.backends.contract.raw_parts import recorded_arrays
from envfleet.backends.local.process import ProcessTransport
from envfleet.backends.local.worker_process import ONE_PLAIN
from envfleet.info_columns import Columns
from envfleet.protocol import Command, Reply, Sample
from envfleet.rollout_loop import Sampled
from envfleet.shared_records import RecordRef, record_ref
from envfleet.weight_frames import Segment, SegmentRef, digest, is_frame, segments_available

CODE_IN_SEGMENT = 16 << 10
"""A policy's code at least this large goes through a segment too (it holds the weights of the
moment, pickled whole); a smaller one goes down the pipes."""


class Segments:
    """The segments of one pool's side of a machine, and which commands name each.

    Args:
        workers: how many workers it sends to.
        enabled: write segments (else every command goes as it came: no memfd here).
    """

    def __init__(self, workers: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self._live: dict[bytes, _Live] = {}  # by the digest of the bytes they hold
        self._owed: list[deque[tuple[bytes, ...]]] = [deque() for _ in range(workers)]
        # (version, digest) of the newest weights: kept for the workers that will want them
        # (a policy's code goes once per worker: its segment goes once they all answered).
        self._newest: dict[str, tuple[int, bytes]] = {}
        self.owing = 0
        """Rollouts' commands out (none: a reply needs no look)."""
        self.written = 0
        """Bytes written into segments (each version's once while it is kept)."""

    def outgoing(self, worker: int, command: Sample) -> Sample:
        """What goes to ``worker`` for ``command``: its weights (and large code) named where
        they are in segments instead of carried.

        While a rollout is out the pool sends its workers nothing else (steps, resets and calls
        are refused), so the worker's replies answer its rollouts' commands in order (one may
        be queued behind another): each is noted here, naming segments or not, and no other
        command is looked at, on the way out or in (a step costs nothing more)."""
        keys: list[bytes] = []
        weights, policy = command.weights, command.policy
        if self.enabled and isinstance(weights, bytes) and is_frame(weights):
            weights = self._share("weights", weights, digest(weights), command.version, keys)
        code = isinstance(policy, bytes) and len(policy) >= CODE_IN_SEGMENT and command.code
        if self.enabled and code and isinstance(policy, bytes):
            with contextlib.suppress(ValueError):  # no digest of the code (a hand-made one)
                key = bytes.fromhex(command.code)
                policy = self._share("code", policy, key, command.version, keys)
        self._owed[worker].append(tuple(keys))
        self.owing += 1
        if weights is command.weights and policy is command.policy:
            return command
        return dataclasses.replace(command, weights=weights, policy=policy)

    def _share(
        self, kind: str, data: bytes, key: bytes, version: int, keys: list[bytes]
    ) -> bytes | SegmentRef:
        """``data``'s segment (written now if it has none), named by one more command."""
        live = self._live.get(key)
        if live is None:
            try:
                live = self._live[key] = _Live(Segment(data, key))
            except OSError:  # no memory for it (or no memfd after all): it goes inline
                return data
            self.written += len(data)
        live.users += 1
        keys.append(key)
        newest = self._newest.get(kind)
        if kind == "weights" and (newest is None or version >= newest[0]):
            self._newest[kind] = (version, key)
            if newest is not None and newest[1] != key:
                self._release(newest[1], 0)  # superseded: gone once no command names it
        return live.segment.ref(version)

    def answered(self, worker: int) -> None:
        """``worker`` answered its oldest command: a :class:`Sample`, if it owes one (see
        :meth:`outgoing`); the segments it named are released."""
        owed = self._owed[worker]
        if owed:
            self.owing -= 1
            for key in owed.popleft():
                self._release(key, 1)

    def lost(self, worker: int) -> None:
        """``worker`` is gone (or replaced): it owes nothing more."""
        owed = self._owed[worker]
        while owed:
            self.owing -= 1
            for key in owed.popleft():
                self._release(key, 1)

    def held(self) -> int:
        """How many segments are kept now."""
        return len(self._live)

    def close(self) -> None:
        """Close every segment (the workers are gone)."""
        for live in self._live.values():
            live.segment.close()
        self._live.clear()
        for owed in self._owed:
            owed.clear()
        self.owing = 0
        self._newest.clear()

    def _release(self, key: bytes, users: int) -> None:
        live = self._live.get(key)
        if live is None:
            return
        live.users -= users
        if live.users <= 0 and all(key != newest[1] for newest in self._newest.values()):
            del self._live[key]
            live.segment.close()


@dataclasses.dataclass
class _Live:
    segment: Segment
    users: int = 0  # commands naming it, unanswered


class SharedWeightsTransport(ProcessTransport):
    """:class:`~envfleet.backends.local.process.ProcessTransport`, each version's weights
    written once into a segment its workers map (see the module docstring)."""

    def __init__(
        self,
        options: TransportOptions,
        *,
        info_columns: bool | Callable[[Columns], None] = False,
        spares: bool = False,
        cores: int | None = None,
    ) -> None:
        self.segments = Segments(len(options.assignment), segments_available())
        # Per worker, the Sample whose part it records in place, and where (till it is sent).
        self._records: dict[int, tuple[Sample, RecordRef]] = {}
        super().__init__(options, info_columns=info_columns, spares=spares, cores=cores)

    def land(self, worker: int, command: Sample, into: Sampled) -> None:
        """``into``'s columns named in ``command`` as it goes, where they are in the pool's
        shared memory (:mod:`envfleet.shared_records`): the worker records its part there and
        nothing is read; else the part is read from the pipe into them."""
        ref = record_ref(recorded_arrays(into))
        if ref is None:
            super().land(worker, command, into)
        else:
            self._records[worker] = (command, ref)

    def read_plain(self, worker: int, timeout: float) -> Replies | None:
        """``worker``'s next reply, waited for up to ``timeout`` on its own
        (:class:`~envfleet.backends.contract.base.LocalPool`): ``None`` when it is one plain
        reply, else what came (none: nothing in time, or commands wait for room in a pipe)."""
        slot = self._workers[worker]
        if self._closed or not slot.alive or self._writing:
            return []
        got: list[Reply | None] = []
        alive = slot.read(got)
        if alive and not got:
            if not slot.poll_alone(max(0, math.ceil(timeout * 1000))):
                return []
            alive = slot.read(got)
        if alive and got == ONE_PLAIN:
            return None
        replies: Replies = []
        self._took(worker, slot, got, not alive, replies)
        return replies

    def submit(self, worker: int, command: Command) -> None:
        if type(command) is Sample:
            record = self._records.pop(worker, None)
            if record is not None and record[0] is command:
                command = dataclasses.replace(command, record=record[1])
            command = self.segments.outgoing(worker, command)
        super().submit(worker, command)

    def wait(
        self, timeout: float | None, want: int = 1, linger: float | None = None
    ) -> list[tuple[int, Reply | WorkerLost | None]]:
        replies = super().wait(timeout, want, linger)
        segments = self.segments
        if segments.owing:
            for worker, reply in replies:
                if isinstance(reply, WorkerLost):
                    segments.lost(worker)
                else:
                    segments.answered(worker)
        return replies

    def restart(self, worker: int, restarts: dict[int, int]) -> None:
        self.segments.lost(worker)
        super().restart(worker, restarts)

    def forked(self) -> None:
        """In a forked child: the segments' descriptors are the parent's (closed here, so that
        a child that lives on holds none of them)."""
        super().forked()
        self.segments.close()

    def close(self, timeout: float) -> None:
        try:
            super().close(timeout)
        finally:
            self.segments.close()


def open_transport(options: TransportOptions) -> SharedWeightsTransport:
    """The process backend's transport (what the registry opens for ``backend="process"``)."""
    return SharedWeightsTransport(options, info_columns=True, spares=options.copy)


def open_local_pool(
    options: TransportOptions, info_columns: Callable[[Columns], None], cores: int
) -> LocalPool:
    """A node's pool of worker processes, as its agent runs it (the contract's
    :class:`~envfleet.backends.contract.base.LocalPool`), each version's weights once in the
    node's shared memory: infos the workers send as columns go to ``info_columns`` as they
    came; its waits count on ``cores`` cores."""
    return SharedWeightsTransport(options, info_columns=info_columns, cores=cores)


__all__ = [
    "CODE_IN_SEGMENT",
    "Segments",
    "SharedWeightsTransport",
    "open_local_pool",
    "open_transport",
]
