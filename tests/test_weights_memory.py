"""Each version's weights once per machine: a frame in shared memory, not a copy per pipe.

Oracles: what crosses each worker's pipe (the bytes its process reads) does not grow with the
weights nor with the workers, while the same pool with its segments turned off reads the whole
weights per worker; the workers map one segment per version, which goes once superseded and
answered, and at close; a policy that changes its weights in place changes its own copy only
(the serial backend's one copy acts the same), and the version is the snapshot sent, whatever
the caller does to its arrays afterwards.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from typing import Any

import numpy as np
import psutil
import pytest

import envfleet
from envfleet import weight_frames
from envfleet.backends.local import shared_weights

MIB = 1 << 20
N, WORKERS = 8, 4


class Big:
    """A policy of ``megabytes`` MB of weights (``big``) whose actions follow ``w``."""

    def __init__(self, fill: float, megabytes: int = 10) -> None:
        self.w = np.full((4, 2), fill)
        self.big = np.zeros(megabytes * MIB // 8)

    def weights(self) -> dict[str, np.ndarray]:
        return {"w": self.w, "big": self.big}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.w, self.big = weights["w"], weights["big"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        return np.asarray(np.argmax(np.asarray(observations) @ self.w, axis=1), dtype=np.int64)


class InPlace:
    """A policy that changes its weights in place as it acts: each call adds 1 to ``c``; every
    env's action is ``c[0] >= 50``. A copy shared by several workers would count their calls
    together."""

    def __init__(self, fill: float) -> None:
        self.c = np.full(1 << 14, fill)  # 128 KiB: out of band, a view of the segment

    def weights(self) -> dict[str, np.ndarray]:
        return {"c": self.c}

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.c = weights["c"]

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        self.c += 1
        return np.full(len(env_ids), self.c[0] >= 50, dtype=np.int64)


def transport(pool: envfleet.Pool) -> shared_weights.SharedWeightsTransport:
    """The process backend's transport of ``pool``."""
    found = pool._transport
    assert isinstance(found, shared_weights.SharedWeightsTransport)
    return found


def worker_pids(pool: envfleet.Pool) -> list[int]:
    return [pid for pid in transport(pool).pids() if pid is not None]


def read_from_pipes(pool: envfleet.Pool) -> list[int]:
    """Bytes each worker process has read so far (its pipe: its envs read no file)."""
    return [psutil.Process(pid).io_counters().read_chars for pid in worker_pids(pool)]


def segments_held() -> int:
    """The weights segments this process holds."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:envfleet-weights")
        except OSError:
            pass
    return held


def segments_mapped(pid: int) -> set[int]:
    """The inodes of the weights segments process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if "memfd:envfleet-weights" in line}


def test_frames_hold_the_arrays_and_segments_map_copy_on_write() -> None:
    weights: dict[str, Any] = {
        "big": np.arange(1 << 12, dtype=np.float32).reshape(64, 64),
        "fortran": np.asfortranarray(np.arange(1 << 12, dtype=np.int16).reshape(32, 128)),
        "strided": np.arange(1 << 13)[::2],  # not contiguous: inside the pickle
        "small": np.ones(3, dtype=np.uint8),
        "scalar": 1.5,
    }
    frame = weight_frames.pack(weights)
    segment = weight_frames.Segment(frame, weight_frames.digest(frame))
    try:
        ref = segment.ref(version=7)
        assert (ref.size, ref.digest) == (len(frame), weight_frames.digest(frame))
        inline, shared, again = (
            weight_frames.load(frame),
            weight_frames.load(ref),
            weight_frames.load(ref),
        )
        for got in (inline, shared, again):
            assert got["scalar"] == 1.5
            for name in ("big", "fortran", "strided", "small"):
                np.testing.assert_array_equal(got[name], weights[name], err_msg=name)
                assert got[name].dtype == weights[name].dtype and got[name].flags.writeable
        assert np.shares_memory(shared["big"], shared["big"]) and shared["big"].base is not None
        shared["big"][0, 0] = -1.0  # this mapping's own page now; the segment's is as written
        inline["big"][0, 0] = -2.0
        assert again["big"][0, 0] == 0.0 and weight_frames.load(frame)["big"][0, 0] == 0.0
        assert weight_frames.load(ref)["big"][0, 0] == 0.0
    finally:
        segment.close()
    with pytest.raises(weight_frames.SegmentUnreadable):
        weight_frames.load(ref)  # closed: nothing to map (or another file: refused)


@pytest.mark.parametrize("workers", [1, WORKERS])
def test_bytes_through_the_pipes_do_not_grow_with_the_weights_or_the_workers(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 MB of weights: each worker reads a command of a few hundred bytes from its pipe for
    the first version (the policy's code, which holds them too, and the weights: two segments'
    names) and for the next (the weights' name); with segments turned off, the whole code and
    weights, each worker."""
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(shared_weights, "segments_available", lambda: False)
        policy = Big(0.5)
        with envfleet.make("CartPole-v1", N, num_workers=workers, seed=0) as pool:
            pool.reset()
            read = [read_from_pipes(pool)]
            first = pool.rollout(policy, 2)
            read.append(read_from_pipes(pool))
            policy.w = np.full((4, 2), -0.5)  # version 2: its 10 MB go out
            second = pool.rollout(policy, 2)
            read.append(read_from_pipes(pool))
            held = transport(pool).segments.held()
        code, weights = (np.subtract(b, a).tolist() for a, b in itertools.pairwise(read))
        assert (first.policy_versions == 1).all() and (second.policy_versions == 2).all()
        if shared:
            assert all(r < 4096 for r in code + weights), (code, weights)
            assert held == 1  # the newest version's weights
        else:
            assert all(20 * MIB <= r < 21 * MIB for r in code), code
            assert all(10 * MIB <= r < 11 * MIB for r in weights), weights
            assert held == 0


def test_one_segment_per_version_mapped_by_every_worker_gone_once_superseded() -> None:
    policy = Big(0.5, megabytes=1)
    assert segments_held() == 0
    with envfleet.make("CartPole-v1", N, num_workers=WORKERS, seed=0) as pool:
        pool.reset()
        pids = worker_pids(pool)
        pool.rollout(policy, 2)
        assert segments_held() == 1
        (first,) = {frozenset(segments_mapped(pid)) for pid in pids}  # the same one, each
        assert len(first) == 1
        policy.w = np.full((4, 2), -0.5)
        pool.rollout_async(policy, 2, env_ids=[0, 1, 2, 3])  # version 2: workers 0 and 1
        policy.w = np.full((4, 2), 0.25)
        pool.rollout_async(policy, 2, env_ids=[4, 5, 6, 7])  # version 3: workers 2 and 3
        assert segments_held() == 2  # version 1's went; 2's is named by unanswered commands
        got = pool.rollout_wait()
        assert got.policy_versions[0].tolist() == [2] * 4 + [3] * 4
        assert segments_held() == 1  # the newest, 3
        assert {frozenset(segments_mapped(pid)) for pid in pids[2:]} != {first}
        assert not any(segments_mapped(pid) & first for pid in pids[2:])  # unmapped as well
    assert segments_held() == 0


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_policy_changing_its_weights_in_place_changes_its_own_copy(kind: str) -> None:
    """Each worker counts its own calls (a shared copy would count them all together): the
    actions are those of the serial backend's one copy. The caller's in-place change after
    ``rollout_async`` reaches no worker: a version is the snapshot sent."""

    def run(backend: str) -> list[envfleet.Rollout]:
        policy = InPlace(0.0)
        with envfleet.make("CartPole-v1", N, backend=backend, seed=0, **workers) as pool:
            pool.reset()
            pool.rollout_async(policy, 30)
            policy.c += 1000  # the learner's in-place update, after the version went
            out = [pool.rollout_wait(), pool.rollout(policy, 30)]  # version 2: from 1000
        return out

    workers: dict[str, Any] = {}
    want = run("serial")
    workers = {"num_workers": WORKERS}
    got = run(kind)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w.actions, g.actions)
        np.testing.assert_array_equal(w.observations, g.observations)
    actions = np.concatenate([g.actions for g in got])
    np.testing.assert_array_equal(actions[:, 0], [0] * 30 + [1] * 30)


def test_a_child_forked_from_the_pool_holds_none_of_its_segments() -> None:
    """A forked child lets go of the pool's segments (a child that lives on would keep their
    memory otherwise); the parent keeps its own and goes on."""
    policy = Big(0.5, megabytes=1)
    with envfleet.make("CartPole-v1", N, num_workers=WORKERS, seed=0) as pool:
        pool.reset()
        pool.rollout(policy, 2)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave at once
            os.write(write, str(segments_held()).encode())
            os._exit(0)
        os.close(write)
        held_in_child = int(os.read(read, 16))
        os.close(read)
        os.waitpid(pid, 0)
        assert held_in_child == 0 and segments_held() == 1
        policy.w = np.full((4, 2), -0.5)
        assert (pool.rollout(policy, 2).policy_versions == 2).all()


def test_a_part_queued_behind_another_keeps_its_segment_until_it_is_answered() -> None:
    """Worker 0 has two parts out, the first naming no segment (it holds the code already),
    the second carrying the code again in a segment (as to a worker rebuilt since): the
    first's answer releases nothing of the second's, whose answer releases it."""
    from envfleet.protocol import Sample

    segments = shared_weights.Segments(1)
    try:
        code = bytes(shared_weights.CODE_IN_SEGMENT)
        key = hashlib.blake2b(code, digest_size=16).hexdigest()  # as the pool's shipper names it
        first = Sample((0,), 4, None, version=1, code=key)
        second = Sample((0,), 4, code, version=1, code=key)
        assert segments.outgoing(0, first) is first
        sent = segments.outgoing(0, second)
        assert isinstance(sent.policy, weight_frames.SegmentRef)
        segments.answered(0)  # the first part's reply
        assert segments.held() == 1 and weight_frames.code(sent.policy) == code
        segments.answered(0)  # the second's
        assert segments.held() == 0 and segments.owing == 0
    finally:
        segments.close()
