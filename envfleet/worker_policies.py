"""The policies a worker keeps for its rollouts (:func:`envfleet.rollout_loop.sample`).

A :class:`~envfleet.protocol.Sample` carries its policy cloudpickled, or only the digest of
code the worker holds already, and the weights of a new version apart from the code. Each
group keeps the policy it unpickled under its digest, so a stateful policy
(:class:`~envfleet.RandomPolicy`'s generators) continues from one rollout to the next, and the
version whose weights it holds.
"""

from __future__ import annotations

import dataclasses
import pickle
import weakref
from collections.abc import Callable
from typing import Any, cast

from envfleet.errors import Phase
from envfleet.guards import env_errors
from envfleet.protocol import EnvFailure, Group, Sample
from envfleet.weight_frames import code as code_of
from envfleet.weight_frames import load

__all__ = ["MissingPolicy", "WeightsFailed", "policy_failure", "policy_of"]

_policies: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
"""Per group: the digest (or bytes) of the policy last received, the policy unpickled from
them, and the version of the weights it holds (``None``: unknown)."""


class MissingPolicy(Exception):
    """The worker lacks the policy's code or the weights of the version asked for (it was
    rebuilt since the pool sent them): the pool sends them again with the same rollout."""


class WeightsFailed(Exception):
    """``policy.load_weights`` raised (its ``__cause__``)."""


def policy_of(group: Group, command: Sample) -> Callable[..., Any]:
    """The policy of ``command``: unpickled from its code, or the one this group keeps under
    the same code (a stateful policy continues), with the weights of ``command.version``
    loaded (``policy.load_weights``) when they came with it."""
    key = command.code or command.policy
    cached = _policies.get(group)
    if command.policy is not None and (cached is None or cached[0] != key):
        cached = [key, pickle.loads(code_of(command.policy)), None]
        _policies[group] = cached
    elif cached is None or cached[0] != key:
        raise MissingPolicy("code")
    policy = cached[1]
    if command.weights is not None:
        try:
            policy.load_weights(load(command.weights))  # inline, or in a segment
        except env_errors() as exc:
            cached[2] = None
            raise WeightsFailed(str(exc)) from exc
        cached[2] = command.version
    elif cached[2] is not None and cached[2] != command.version:
        raise MissingPolicy("weights")
    elif cached[2] is None and hasattr(policy, "load_weights") and command.code:
        cached[2] = command.version  # the code's own weights are this version's
    return cast(Callable[..., Any], policy)


def policy_failure(exc: BaseException, what: str) -> EnvFailure:
    """The failure of the policy (``what`` it did), not of an env."""
    failure = EnvFailure.capture(None, Phase.STEP, exc)
    return dataclasses.replace(failure, message=f"the rollout's policy {what}: {failure.message}")
