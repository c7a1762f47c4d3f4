"""``examples/ppo_rollouts.py``: PPO whose policy acts on the workers, the learner one version
behind, on one machine and on a fake cluster of two nodes (``ray.cluster_utils.Cluster``,
shared by the module: the driver's node and another).

Oracles: the collectors' first rollouts are the same (the workers act as the driver would);
every update after the first learns from the version before the learner's, and the PPO ratio
before it says so (exactly 1 on fresh data); the run on two nodes is the run on one machine,
episode for episode.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
import ray
import torch
from ray.cluster_utils import Cluster

from tests.ray_helpers import no_node_leaks

__all__ = ["no_node_leaks"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parent.parent
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 << 20}
SHORT = ["--num-envs=6", "--num-steps=32", "--total-timesteps=3072", "--window=10"]
"""16 updates of 6 envs x 32 steps: CartPole's returns double from the first episodes."""


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("ppo_rollouts", ROOT / "examples/ppo_rollouts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        torch.set_num_threads(threads)  # main() sets the learner's


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    assert not ray.is_initialized()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def run(example: ModuleType, tmp_path: Path, *args: str) -> dict[str, Any]:
    summary: dict[str, Any] = example.main([*args, f"--out-dir={tmp_path}"])
    assert (tmp_path / "ppo_rollouts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return summary


def assert_consistent(summary: dict[str, Any], collector: str) -> None:
    """The fields agree with each other, and the updates lag as the collector says."""
    iterations = summary["iterations"]
    assert summary["collector"] == collector and summary["seed"] == 1
    assert iterations == 16 and summary["global_step"] == iterations * 6 * 32
    returns = summary["episode_returns"]
    assert summary["episodes"] == len(returns) > 20
    assert sum(returns) <= summary["global_step"]  # CartPole: 1 per step, finished episodes
    assert summary["mean_return_last_10"] == pytest.approx(np.mean(returns[-10:]))
    assert summary["best_return"] == max(returns)
    deviations = summary["max_ratio_deviation_before_update"]
    assert len(deviations) == iterations
    if collector == "sync":  # fresh data: the learner's weights acted
        assert summary["policy_lags"] == {"0": iterations}
        assert max(deviations) < 1e-5
    else:  # the first update on the first weights, then each one version behind
        assert summary["policy_lags"] == {"0": 1, "1": iterations - 1}
        assert deviations[0] < 1e-5 and min(deviations[1:]) > 1e-3
    # It learns: the last episodes last about twice as long as the first ones.
    assert np.mean(returns[-10:]) > 1.5 * np.mean(returns[:10]), returns


def test_the_collectors_act_alike_and_the_rollouts_lag_by_one(example: ModuleType) -> None:
    """The first rollout of each collector is the same (same envs, seeds and weights: the
    workers act as the driver's policy would); after an update, ``sync`` acts with the new
    weights at once, ``rollouts`` with them one rollout later (the one out was sent before)."""
    import gymnasium

    args = example.parse_args([*SHORT, "--backend=process", "--num-workers=3"])
    space = gymnasium.spaces.Discrete(2)
    batches: dict[str, list[Any]] = {}
    for name, kind in (("rollouts", example.Rollouts), ("sync", example.Sync)):
        torch.manual_seed(0)  # the same first weights for both
        actor = example.mlp(4, 2, 0.01)
        policy = example.envfleet.TorchPolicy(actor, space, seed=args.seed)
        collector = kind(args, policy)
        try:
            got = [collector.next(1)]
            with torch.no_grad():  # an update: the second version
                for p in actor.parameters():
                    p.add_(0.5)
            got += [collector.next(2), collector.next(3)]
        finally:
            collector.close()
        batches[name] = got
    first, same = batches["rollouts"][0], batches["sync"][0]
    for field in ("obs", "actions", "rewards", "dones", "next_obs"):
        np.testing.assert_array_equal(getattr(first, field), getattr(same, field), err_msg=field)
    assert [b.version for b in batches["rollouts"]] == [1, 1, 2]
    assert [b.version for b in batches["sync"]] == [1, 2, 3]
    acted = batches["rollouts"][2].weights  # the version that acted, kept: the updated one
    for name, value in batches["sync"][1].weights.items():
        np.testing.assert_array_equal(acted[name], value)
    assert not np.array_equal(batches["rollouts"][1].weights["0.weight"], acted["0.weight"])


def test_on_two_nodes_it_learns_one_version_behind_as_on_one_machine(
    example: ModuleType, cluster: Cluster, tmp_path: Path
) -> None:
    """On the cluster (a sub-pool per node, the policy acting there) the run is the one of a
    single machine's workers, episode for episode: each env's actions depend only on its seed and
    the weights; the learner updates one version behind, and learns."""
    nodes = run(example, tmp_path / "nodes", *SHORT, f"--address={cluster.address}")
    assert nodes["backend"] == "ray" and nodes["nodes"] == 2
    assert_consistent(nodes, "rollouts")
    alone = run(example, tmp_path / "alone", *SHORT, "--backend=serial")
    assert alone["nodes"] == 0
    assert alone["episode_returns"] == nodes["episode_returns"]
    assert alone["max_ratio_deviation_before_update"] == pytest.approx(
        nodes["max_ratio_deviation_before_update"], rel=1e-4, abs=1e-6
    )


def test_sync_is_the_same_ppo_without_the_lag(example: ModuleType, tmp_path: Path) -> None:
    """No lag: the learner's weights acted, and both ratios are PPO's own (the decoupled one's
    weights are exactly 1), episode for episode."""
    sync = run(example, tmp_path / "behaviour", *SHORT, "--collector=sync")
    assert_consistent(sync, "sync")
    decoupled = run(
        example, tmp_path / "decoupled", *SHORT, "--collector=sync", "--ratio=decoupled"
    )
    assert decoupled["episode_returns"] == sync["episode_returns"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_version_behind_it_reaches_475(example: ModuleType, tmp_path: Path) -> None:
    """Seed 1 on two worker processes: a mean return of 475 over the last 20 episodes within
    60k env steps (32.5k here; the baseline, sync, 35.6k)."""
    summary = run(
        example, tmp_path, "--backend=process", "--num-workers=2", "--total-timesteps=60000"
    )
    assert summary["solved_at"] is not None and summary["solved_at"] <= 60_000, summary["solved_at"]
    assert summary["mean_return_last_20"] >= 475
    assert summary["policy_lags"] == {"0": 1, "1": summary["iterations"] - 1}
