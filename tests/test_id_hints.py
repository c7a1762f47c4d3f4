"""An unknown env id: the nearest registered ids, and an extra to install only when the id
belongs to it (``envfleet.id_hints``), with no traceback of Gymnasium's before the message.

A missing package is simulated in a fresh interpreter (``sys.modules[name] = None``), where
nothing has registered the ids it would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envfleet
from envfleet.id_hints import ATARI_GAMES, is_atari_id, nearest_ids

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
import envfleet
messages = {}
for env_id in sys.argv[2:]:
    try:
        envfleet.EnvSpec.from_user(env_id)
    except ValueError as exc:
        messages[env_id] = [str(exc), exc.__cause__ is None and exc.__suppress_context__]
    else:
        messages[env_id] = None
print(json.dumps(messages))
"""


def messages_without(
    packages: list[str], *env_ids: str, cwd: Path = ROOT
) -> dict[str, list[str | bool] | None]:
    """What ``EnvSpec.from_user(id)`` says for each id where ``packages`` cannot be imported:
    the message and whether the error stands alone (no chained Gymnasium error)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(packages), *env_ids],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, list[str | bool] | None] = json.loads(result.stdout)
    return found


ATARI_HINT = "Atari ids need ale-py: pip install 'envfleet[atari]'"


def test_without_ale_py_only_atari_ids_suggest_the_atari_extra() -> None:
    atari = ["ALE/Pong-v5", "Pong-v0", "PongNoFrameskip-v4", "Breakout-ramDeterministic-v4"]
    others = ["NoSuchLegacy-v0", "NoSuchGame-v0", "CartPol-v1", "NoSuchGameNoFrameskip-v4"]
    messages = messages_without(["ale_py"], *atari, *others)
    for env_id in atari:
        found = messages[env_id]
        assert found is not None
        message, alone = found
        assert message == f"unknown environment id {env_id!r}: {ATARI_HINT}"
        assert alone  # raised from None: no Gymnasium traceback before it
    for env_id in others:
        found = messages[env_id]
        assert found is not None
        assert "pip install" not in str(found[0]), found
    assert messages["CartPol-v1"] == [
        "unknown environment id 'CartPol-v1'; did you mean 'CartPole-v1'?",
        True,
    ]


def test_without_gym_a_mistyped_id_does_not_suggest_the_legacy_extra(tmp_path: Path) -> None:
    """Only an id whose own module needs the legacy gym names ``envfleet[legacy]``."""
    (tmp_path / "old_sim.py").write_text("import gym\n")
    messages = messages_without(
        ["gym", "shimmy"], "CartPol-v1", "NoSuchLegacy-v0", "old_sim:OldSim-v0", cwd=tmp_path
    )
    for env_id in ("CartPol-v1", "NoSuchLegacy-v0"):
        found = messages[env_id]
        assert found is not None
        assert "legacy" not in str(found[0]) and "pip install" not in str(found[0])
    found = messages["old_sim:OldSim-v0"]
    assert found is not None
    assert found[0] == (
        "unknown environment id 'old_sim:OldSim-v0': its module needs the legacy gym (and "
        "Shimmy, to convert its envs): pip install 'envfleet[legacy]'"
    )


def test_make_raises_the_hint_alone() -> None:
    with pytest.raises(ValueError) as error:
        envfleet.make("CartPol-v1", 2, backend="serial")
    assert str(error.value) == "unknown environment id 'CartPol-v1'; did you mean 'CartPole-v1'?"
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_nearest_ids_are_the_closest_registered_ones_only() -> None:
    registered = ["CartPole-v0", "CartPole-v1", "Acrobot-v1", "ALE/Pong-v5", "ALE/Pooyan-v5"]
    assert nearest_ids("CartPol-v1", registered) == ["CartPole-v1"]
    assert nearest_ids("CartPole-v3", registered) == ["CartPole-v0", "CartPole-v1"]
    assert nearest_ids("ALE/Pongg-v5", registered) == ["ALE/Pong-v5"]
    assert nearest_ids("cartpole-v1", registered) == ["CartPole-v1"]
    assert nearest_ids("mymodule:CartPol-v1", registered) == ["CartPole-v1"]
    assert nearest_ids("MySim-v0", registered) == []
    assert nearest_ids("NoSuchLegacy-v0", registered) == []


def test_nothing_close_says_so_and_never_names_an_extra() -> None:
    with pytest.raises(ValueError) as error:
        envfleet.EnvSpec.from_user("NoSuchLegacy-v0")
    assert str(error.value) == (
        "unknown environment id 'NoSuchLegacy-v0': no registered id is close to it"
    )


def test_the_old_atari_ids_are_those_of_the_atari_games() -> None:
    for env_id in ("Pong-v0", "Pong-v4", "PongNoFrameskip-v4", "Pong-ramDeterministic-v4"):
        assert is_atari_id(env_id)
    for env_id in ("NoSuchLegacy-v0", "Pong-v5", "CartPole-v0", "MyPong-v0"):
        assert not is_atari_id(env_id)
    assert len(ATARI_GAMES) == 62


def test_the_atari_games_are_the_ones_ale_py_registers() -> None:
    """The list stands in for ale-py where it is missing: it must match what ale-py registers."""
    import ale_py
    import gymnasium

    gymnasium.register_envs(ale_py)
    old = {
        env_id
        for env_id, spec in gymnasium.registry.items()
        if "/" not in env_id and "ale_py" in str(spec.entry_point)
    }
    assert old and all(is_atari_id(env_id) for env_id in old)
    games = {env_id.split("-")[0].removesuffix("NoFrameskip").removesuffix("Deterministic")
             for env_id in old}  # fmt: skip
    assert games == ATARI_GAMES
