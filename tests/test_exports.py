"""Pins the public API: adding or removing a name from ``envfleet.__all__`` is a decision."""

from __future__ import annotations

import envfleet

EXPECTED_ALL = {
    "AlreadyPendingError",
    "AutoresetMode",
    "Backend",
    "BrokenPoolError",
    "ClosedPoolError",
    "EnvError",
    "EnvRaisedError",
    "EnvSpec",
    "EnvTimeoutError",
    "NoPendingError",
    "OnError",
    "Phase",
    "Policy",
    "Pool",
    "PoolStateError",
    "RandomPolicy",
    "Rollout",
    "RemoteError",
    "ResetNeededError",
    "RemoteTraceback",
    "RestartLimitError",
    "WorkerDiedError",
    "__version__",
    "make",
    "register_vector",
}


def test_every_name_in_all_exists() -> None:
    missing = [name for name in envfleet.__all__ if not hasattr(envfleet, name)]
    assert missing == []


def test_all_has_no_duplicates() -> None:
    assert len(envfleet.__all__) == len(set(envfleet.__all__))


def test_all_is_the_expected_set() -> None:
    assert set(envfleet.__all__) == EXPECTED_ALL


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from envfleet import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == EXPECTED_ALL


def test_exception_hierarchy() -> None:
    assert issubclass(envfleet.EnvError, RuntimeError)
    assert issubclass(envfleet.EnvRaisedError, envfleet.EnvError)
    assert issubclass(envfleet.WorkerDiedError, envfleet.EnvError)
    assert issubclass(envfleet.EnvTimeoutError, envfleet.WorkerDiedError)
    assert issubclass(envfleet.RestartLimitError, envfleet.EnvError)
    for error in (
        envfleet.ClosedPoolError,
        envfleet.BrokenPoolError,
        envfleet.NoPendingError,
        envfleet.AlreadyPendingError,
        envfleet.ResetNeededError,
    ):
        assert issubclass(error, envfleet.PoolStateError)
    assert issubclass(envfleet.PoolStateError, RuntimeError)
    assert {p.value for p in envfleet.Phase} >= {"make", "reset", "step", "call", "close"}
    assert {b.value for b in envfleet.Backend} >= {"serial", "process"}
