"""Pins the public API: adding or removing a name from ``envfleet.__all__`` is a decision."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    "TorchPolicy",
    "RemoteError",
    "ResetNeededError",
    "RemoteTraceback",
    "RestartLimitError",
    "WorkerDiedError",
    "__version__",
    "make",
    "make_sb3",
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


def test_dir_shows_the_public_names_not_the_modules_own_imports() -> None:
    shown = dir(envfleet)
    assert set(envfleet.__all__) | {"sb3"} <= set(shown)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(shown)
    assert [name for name in shown if not name.startswith("__")] == sorted(
        {*envfleet.__all__, "sb3"} - {"__version__"}
    )


def test_make_sb3_is_public_and_cheap_until_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """``from envfleet import *`` gives ``make_sb3`` without importing SB3 (or torch); the
    call imports it, and says what to install where it is missing."""
    code = (
        "import sys; from envfleet import *; "
        "print(callable(make_sb3), 'stable_baselines3' in sys.modules, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["True", "False", "False"]
    monkeypatch.setitem(sys.modules, "envfleet.sb3", None)  # as if SB3 could not be imported
    with pytest.raises(ImportError):
        envfleet.make_sb3("CartPole-v1", 2)


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
