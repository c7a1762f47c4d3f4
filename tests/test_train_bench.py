"""``bench/train.py``'s measurements (:mod:`envfleet.benchmark.training`), each run short: what
they count (the version acting in each rollout handed over, the bytes of each version per node,
every env-step started delivered or dropped), never how fast. The node rows run on a fake
cluster (a head and two worker nodes of ``ray.cluster_utils.Cluster``, shared by the module).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import envfleet
from bench import common
from bench.envs import NoOpEnv
from envfleet.benchmark import training
from envfleet.benchmark.training import ArrayPolicy, Figure
from tests.ray_helpers import no_node_leaks

__all__ = ["no_node_leaks"]  # fixtures, used by name


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[str]]:
    with common.fake_cluster(3) as cluster:
        yield [node.node_id for node in cluster.worker_nodes]


def test_overlap_hands_over_each_rollout_acted_by_the_version_started_for_it() -> None:
    env = {"sleep_s": 0.002}
    with envfleet.make(NoOpEnv, 2, num_workers=2, env_kwargs=env, seed=0) as pool:
        got = training.overlap(pool, ArrayPolicy(), 5, 0.01, 3)
    # One rollout before the timed iterations, one per iteration (4 in all), each handed over
    # with the version started for it alone (the pool counts 1 for the first: new weights).
    assert got["started"] == [1, 2, 3, 4, 5]
    assert got["handed"] == [[v] for v in got["started"]]
    assert all(got[k] > 0 for k in ("collect_s", "learn_s", "sync_s", "async_s"))


def test_each_versions_weights_cross_to_each_node_once_whatever_its_workers(
    nodes: list[str],
) -> None:
    """Three workers on two nodes (two on one, one on the other): each node is sent the bytes
    of the weights once per version, the pool twice."""
    policy = ArrayPolicy(1 << 20)
    size = len(pickle.dumps(policy.weights(), protocol=pickle.HIGHEST_PROTOCOL))
    with envfleet.make(NoOpEnv, 3, backend="ray", nodes=nodes, num_workers=3) as pool:
        got = training.weight_bytes(pool, policy, versions=2)
    assert got["weights_bytes"] == size and sorted(got["workers"]) == [1, 2], got
    # Each node: the weights once per version, and the command's few hundred bytes besides.
    assert all(1.0 < share < 1.001 for share in got["per_node_per_version"]), got
    assert 2.0 < got["per_version"] < 2.002
    assert all(0 < sent < 2000 for sent in got["same_version_bytes"]), got  # no weights
    assert all(0 < read < 2000 for read in got["read_per_worker_per_version"]), got


def test_a_process_backends_workers_read_a_version_through_shared_memory_not_their_pipes() -> None:
    policy = ArrayPolicy(1 << 20)
    with envfleet.make(NoOpEnv, 2, backend="process", num_workers=2) as pool:
        got = training.weight_bytes(pool, policy, versions=2)
    assert got["workers"] == [] and got["per_version"] == 0.0  # no nodes
    # A command's few hundred bytes down each pipe, not the weights' megabyte.
    assert len(got["read_per_worker_per_version"]) == 2, got
    assert all(0 < read < 2000 for read in got["read_per_worker_per_version"]), got


def test_collect_delivers_or_drops_every_env_step_it_started() -> None:
    """Two workers, the second's envs 10x slower; ``rollout_wait(min_envs=2, max_lag=0)``: the
    fast worker's parts are handed over as they come, the slow one's (a version behind once the
    fast one went again) dropped and restarted; none lost, none counted twice."""
    env = [{"sleep_s": 0.002}] * 2 + [{"sleep_s": 0.02}] * 2
    with envfleet.make(NoOpEnv, 4, num_workers=2, env_kwargs=env, seed=0) as pool:
        got = training.collect(pool, ArrayPolicy(), 5, 1.0, 2, max_lag=0)
        assert pool.stats().rollout_parts_dropped >= 1
        sync = training.collect(pool, ArrayPolicy(), 5, 0.3, None, max_lag=0)
    assert got["delivered"] + got["dropped"] == got["started"], got
    assert got["dropped"] >= 10 and got["dropped"] % 10 == 0  # whole parts: 2 envs x 5 steps
    per_env = np.array(got["per_env"])
    assert (per_env % 5 == 0).all() and per_env[0] == per_env[1] and per_env[2] == per_env[3]
    assert per_env[0] > per_env[2]  # the fast worker's parts came more often
    assert sync["delivered"] == sync["started"] and sync["dropped"] == 0  # nothing behind
    assert len(set(sync["per_env"])) == 1


def test_a_figure_is_judged_by_its_ratio_against_its_bounds() -> None:
    assert Figure("a", 1.05, "s", "b", 1.0, high=1.1).met is True
    assert Figure("a", 1.2, "s", "b", 1.0, high=1.1).met is False
    assert Figure("a", 8.0, "B", "b", 4.0, 1.98, 2.02).met is True
    assert Figure("a", 3.0, "", "b", 2.0).met is None  # shown, no target
    assert Figure("a", 3.0, "", "b", 0.0).ratio is None  # nothing to set it against
    rows = training.figure_table([Figure("a", 1.2, "s", "b", 1.0, high=1.1)]).row_count
    assert rows == 1


BUSY_S = 0.002
"""Seconds of CPU :class:`BusyEnv` spends a step."""


class BusyEnv(NoOpEnv):
    """A :class:`~bench.envs.NoOpEnv` whose step keeps its core busy for ``BUSY_S`` of CPU."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        until = time.thread_time() + BUSY_S
        while time.thread_time() < until:
            pass
        return super().step(action)


def test_per_cpu_counts_every_env_step_handed_over_and_the_whole_machines_cpu() -> None:
    """``per_cpu``: ``rounds`` rollouts of every env handed over after one not timed, each
    counted whole; the whole machine's CPU counts the workers' (every env-step's ``BUSY_S``),
    which the driver's does not (the kernel's count, in ticks of 10 ms: a quarter off at most)."""
    with envfleet.make(BusyEnv, 4, num_workers=2, seed=0) as pool:
        got = training.per_cpu(pool, ArrayPolicy(1 << 16), 5, 6)
        assert pool.stats().rollout_parts_dropped == 0
    assert got["env_steps"] == 6 * 5 * 4, got
    assert got["wall_s"] > 6 * 5 * 2 * BUSY_S and got["cpu_s"] > 0, got  # 2 envs a worker
    assert got["machine_cpu_s"] >= 0.75 * got["env_steps"] * BUSY_S > got["cpu_s"], got
