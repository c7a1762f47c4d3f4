"""The examples run as a user runs them (``python examples/...``), with tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(
    script: str, *args: str, timeout: float = 120, cwd: Path = ROOT
) -> tuple[list[str], dict[str, Any]]:
    """Run an example; return its output lines and its final ``summary: {...}`` line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines and lines[-1].startswith("summary: "), result.stdout[-2000:]
    return lines, json.loads(lines[-1].removeprefix("summary: "))


def _read_png(path: Path) -> np.ndarray:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels: np.ndarray = image.imread(path)
    return pixels


def test_ppo_cartpole_prints_its_curve_and_saves_the_plot(tmp_path: Path) -> None:
    """The plot goes into the output folder (``runs/`` by default), not the current one."""
    pytest.importorskip("torch")
    lines, summary = _run(
        "ppo_cartpole.py",
        "--total-timesteps=1024",
        "--num-envs=4",
        "--num-steps=32",
        "--backend=serial",
        "--window=5",
        cwd=tmp_path,
    )
    plot = tmp_path / "runs" / "ppo_cartpole.png"
    assert [path.name for path in tmp_path.iterdir()] == ["runs"]
    assert summary["plot"] == "runs/ppo_cartpole.png"
    curve = [line for line in lines if line.startswith("iteration=")]
    assert [line.split()[0] for line in curve] == [f"iteration={i}/8" for i in range(1, 9)]
    steps = [int(line.split()[1].removeprefix("global_step=")) for line in curve]
    assert steps == [128 * i for i in range(1, 9)]
    assert summary["global_step"] == 1024 and summary["solved_at"] is None
    # An untrained CartPole policy ends an episode every ~20 steps: many episodes in 1024.
    assert summary["episodes"] >= 5
    assert 8 <= summary["mean_return_last_5"] <= 500
    pixels = _read_png(plot)
    assert pixels.shape[:2] == (400, 700)  # 7x4 inches at 100 dpi
    assert np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0).shape[0] > 10  # not blank


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_cartpole_reaches_475(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _, summary = _run(
        "ppo_cartpole.py",
        "--backend=process",
        "--num-workers=2",
        "--total-timesteps=150000",
        f"--plot={tmp_path / 'curve.png'}",
        timeout=380,
    )
    assert summary["solved_at"] is not None, summary
    assert summary["mean_return_last_20"] >= 475
    assert (tmp_path / "curve.png").exists()


def test_atari_rollout_saves_the_frames(tmp_path: Path) -> None:
    out = tmp_path / "data" / "atari_rollout.npz"
    lines, summary = _run(
        "atari_rollout.py",
        "--frames=64",
        "--num-envs=4",
        "--backend=serial",
        "--seed=3",
        f"--out-dir={tmp_path / 'data'}",
    )
    assert summary["out"] == str(out)
    assert any(line.startswith("frames=64/64 ") for line in lines)
    assert summary["frames"] == 64 and summary["observation_shape"] == [105, 80]
    with np.load(out) as data:
        assert str(data["env_id"]) == "ALE/Pong-v5" and int(data["num_envs"]) == 4
        observations = data["observations"]
        assert observations.shape == (16, 4, 105, 80) and observations.dtype == np.uint8
        assert data["actions"].shape == (16, 4)
        assert set(np.unique(data["actions"])) <= set(range(6))
        assert set(np.unique(data["rewards"])) <= {-1.0, 0.0, 1.0}
        assert data["terminations"].dtype == np.bool_ and data["truncations"].shape == (16, 4)
        assert float(data["rewards"].sum()) == summary["reward_sum"]
        assert len(data["episode_returns"]) == summary["episodes"] == 0  # Pong takes longer
        # Row 0 is each env's first observation: env 1 was reset with seed 3 + 1.
        import ale_py

        gymnasium.register_envs(ale_py)
        reference = gymnasium.make("ALE/Pong-v5", obs_type="grayscale")
        first, _ = reference.reset(seed=4)
        reference.close()
        expected = first.reshape(105, 2, 80, 2).astype(np.float64).mean(axis=(1, 3))
        np.testing.assert_array_equal(observations[0, 1], np.floor(expected + 0.5))
        assert len({observations[t, 0].tobytes() for t in range(16)}) > 1  # the game moves


def _ppo_atari(tmp_path: Path, *args: str) -> tuple[list[str], dict[str, Any]]:
    plot = tmp_path / "pong.png"
    lines, summary = _run(
        "ppo_atari_async.py",
        "--total-timesteps=128",
        "--num-envs=4",
        "--num-steps=16",
        "--update-epochs=1",
        f"--plot={plot}",
        *args,
        timeout=180,
    )
    curve = [line for line in lines if line.startswith("iteration=")]
    assert [line.split()[0] for line in curve] == ["iteration=1/2", "iteration=2/2"]
    assert summary["global_step"] == 128 and summary["rollout_sps"] > 0
    # Every action is one record; each env's last one is in flight when the rollout ends, so
    # the first update trains on all but 4 and the next ones (with those carried) on 4 x 16.
    assert summary["trained_per_iteration"] == [60, 64]
    assert summary["episodes"] == 0  # a Pong episode takes longer than 32 steps per env
    pixels = _read_png(plot)
    assert pixels.shape[:2] == (400, 1000)  # 10x4 inches at 100 dpi
    assert np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0).shape[0] > 10  # not blank
    return lines, summary


@pytest.mark.timeout(200)
def test_ppo_atari_async_trains_on_double_buffered_rollouts(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _, summary = _ppo_atari(tmp_path, "--num-workers=2")
    assert summary["env_backend"] == "envfleet" and summary["async_batches"] == 2


@pytest.mark.timeout(200)
def test_ppo_atari_async_runs_on_gymnasium_async_vector_env(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _, summary = _ppo_atari(tmp_path, "--env-backend=gymnasium")
    assert summary["env_backend"] == "gymnasium" and summary["async_batches"] == 1


def _grid_gae(
    rewards: np.ndarray, dones: np.ndarray, values: np.ndarray, gamma: float, lam: float
) -> np.ndarray:
    """CleanRL's GAE over a ``[step, env]`` grid; ``values[T]`` bootstraps the last step."""
    advantages = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1])
    for t in reversed(range(rewards.shape[0])):
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * values[t + 1] * nonterminal - values[t]
        running = delta + gamma * lam * nonterminal * running
        advantages[t] = running
    return advantages


def test_ppo_atari_async_gae_per_env_matches_the_grid_whatever_the_interleaving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ppo_atari_async", EXAMPLES / "ppo_atari_async.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # its dataclass looks itself up
    spec.loader.exec_module(example)

    rng = np.random.default_rng(0)
    steps, num_envs = 6, 4
    rewards = rng.normal(size=(steps, num_envs)).astype(np.float32)
    dones = (rng.random((steps, num_envs)) < 0.25).astype(np.float32)
    values = rng.normal(size=(steps + 1, num_envs)).astype(np.float32)
    expected = _grid_gae(rewards, dones, values, 0.99, 0.95)
    # Records as async batches would give them: any interleaving that keeps each env's order,
    # then each env's last record in flight (its value bootstraps).
    order = rng.permutation(np.repeat(np.arange(num_envs), steps))
    env = np.concatenate([order, np.arange(num_envs)])
    step_of = np.zeros(len(env), dtype=np.int64)
    seen = np.zeros(num_envs, dtype=np.int64)
    for i, e in enumerate(env):
        step_of[i], seen[e] = seen[e], seen[e] + 1
    complete = np.arange(len(env)) < len(order)
    record_rewards = np.where(complete, rewards[np.minimum(step_of, steps - 1), env], 0)
    record_dones = np.where(complete, dones[np.minimum(step_of, steps - 1), env], 0)
    pending = np.arange(len(order), len(env))
    advantages = example.gae(
        env, record_rewards, record_dones, values[step_of, env], complete, pending, 0.99, 0.95
    )
    np.testing.assert_allclose(advantages[complete], expected[step_of[complete], env[complete]],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    assert not advantages[~complete].any()
