"""Shipping a rollout's policy: its code once, each version's weights where they are missing.

A policy may keep its code and its weights apart: ``policy.weights()`` returns a mapping of
names to arrays (or tensors) and ``policy.load_weights(mapping)`` loads them. The pool then
pickles the policy's code once (per policy object) and, for each rollout, its weights; each
worker's :class:`~envfleet.protocol.Sample` carries the code only where the worker lacks it,
and the weights only where it holds another version::

    rollout_async(policy) ── version: the caller's, or one more when the weights changed
    Sample(code=digest, policy=code | None, version, weights=frame | None) per worker
    worker: the policy kept under its digest; load_weights(weights) when they came
    node agents: one message per node, the frame once in it, after the pickle, as it is
    worker processes: the frame once per machine in shared memory, the Sample names it

The weights are pickled once per version into a frame (:mod:`envfleet.weight_frames`): the
version's snapshot, whatever the caller does to its arrays afterwards. The process backend's
pool side, and each node's agent, writes a frame once into a segment of shared memory that its
workers map (:mod:`envfleet.backends.local.shared_weights`); the other backends carry it inline.

A worker that was rebuilt since (it lost what it held) answers
:class:`~envfleet.worker_policies.MissingPolicy`; the pool forgets what it thought the worker had
and sends its part again with the code and the weights (:meth:`Shipper.command` with
``force``). A policy without ``weights()`` travels whole, as before; its versions only stamp.
"""

from __future__ import annotations

import hashlib
from typing import Any

from envfleet.protocol import Sample
from envfleet.rollouts import Policy, policy_bytes
from envfleet.torch_policy import TorchPolicy
from envfleet.weight_frames import digest, pack


class Shipper:
    """What each worker holds of the rollouts' policy, and the commands that complete it."""

    def __init__(self) -> None:
        self.version = 0
        """The newest version sent."""
        self._policy: Any = None  # the policy whose code was pickled last
        self._code = b""
        self._digest = ""
        self._weights: bytes | None = None
        self._key: str | None = None  # a digest of the weights (or code) sent last
        self._have: dict[int, tuple[str, int]] = {}  # per worker: (code digest, version)

    def prepare(self, policy: Policy, version: int | None) -> int:
        """Pickle what ``policy`` sends now (its code once, its weights each time) and return
        the version that acts: ``version``, or the last one, one more when the weights (or,
        without weights, the code) differ from those sent last (weights sent under the caller's
        version are not hashed: the next version the pool counts is one more)."""
        if policy is not self._policy:
            self._policy = policy
            self._code = policy_bytes(policy)
            self._digest = hashlib.blake2b(self._code, digest_size=16).hexdigest()
            self._have.clear()
        own: Any = policy  # a policy with weights apart from its code
        if callable(getattr(own, "weights", None)) and callable(getattr(own, "load_weights", None)):
            # The version's snapshot (one copy), its contents hashed only when the pool counts
            # the versions: the caller's version says which weights these are.
            views = isinstance(own, TorchPolicy)  # pack copies them: no snapshot before
            snapshot = own.weights(copy=False) if views else own.weights()
            self._weights = pack(snapshot, hashed=version is None)
            key = digest(self._weights).hex()
        else:
            self._weights, key = None, self._digest
        if version is None:
            version = self.version + (self._key is not None and key != self._key)
            version = max(version, 1)
        elif isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int or None, got {version!r}")
        self._key = key
        self.version = max(self.version, int(version))
        return int(version)

    def command(
        self,
        worker: int,
        env_ids: tuple[int, ...],
        steps: int,
        version: int,
        check_actions: bool,
        force: bool = False,
    ) -> Sample:
        """``worker``'s :class:`Sample` of ``env_ids``: the code where it lacks it (or
        ``force``), the weights where it holds another version."""
        have = self._have.get(worker)
        send_code = force or have is None or have[0] != self._digest
        weights = self._weights
        send_weights = weights is not None and (send_code or have is None or have[1] != version)
        self._have[worker] = (self._digest, version)
        return Sample(
            env_ids,
            int(steps),
            self._code if send_code else None,
            check_actions,
            version=version,
            code=self._digest,
            weights=weights if send_weights else None,
        )

    def forget(self, worker: int) -> None:
        """``worker`` lost what it held (it was rebuilt)."""
        self._have.pop(worker, None)


__all__ = ["Shipper"]
