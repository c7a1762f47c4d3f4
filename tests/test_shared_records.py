"""A process worker records its part of a rollout straight into the pool's shared memory.

The recycler's shared blocks (memfds) and how they are named and mapped; then the rollout
oracles and fault tests of the process backend run again with every rollout's arrays in a
shared block (``LEAST`` at 0: the suite's rollouts are small), so each part goes in place:
values, dtypes and nests as SyncVectorEnv's, a worker killed or lost mid-rollout, async parts
handed over apart, versions stamped.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
from collections.abc import Iterator

import numpy as np
import pytest

import envfleet
from envfleet import recycling, shared_records
from envfleet.recycling import Recycler, locate
from envfleet.rollouts import Out
from envfleet.shared_records import record_ref, recorded_views
from tests.test_pool_rollout import (  # noqa: F401  (run again here, in place)
    test_a_worker_lost_mid_rollout,
    test_restart_mid_rollout_is_the_pools_own_loop_of_steps,
    test_rollout_is_that_many_steps_of_sync_vector_env,
)
from tests.test_rollout_async import (  # noqa: F401
    test_async_rollouts_are_the_synchronous_ones_with_each_version_stamped,
    test_each_workers_part_comes_once_and_is_restarted_at_once,
)
from tests.test_rollout_faults import (  # noqa: F401
    test_a_worker_killed_mid_rollout_raises_naming_it,
    test_a_worker_killed_mid_rollout_restarts_its_part_counted_once,
)

IMPORTED = {name for name in dir() if name.startswith("test_")}
"""The rollout tests of other modules run here again."""

BACKENDS_HERE = ["process"]
"""The imported oracles' backend: the process backend's, whose workers record in place."""

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfds: Linux")


@pytest.fixture(scope="module", autouse=True)
def every_rollout_in_place() -> Iterator[list[int]]:
    """Every rollout's arrays in a shared block, and a count of the parts that went in place
    (checked after each test: the oracles above must have taken this path)."""
    placed: list[int] = [0]
    original = Out.placed

    def counted(self: Out, *args: object) -> object:
        placed[0] += 1
        return original(self, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recycling, "LEAST", 0)
        patch.setattr(Out, "placed", counted)
        yield placed


@pytest.fixture(autouse=True)
def went_in_place(
    every_rollout_in_place: list[int], request: pytest.FixtureRequest
) -> Iterator[None]:
    before = every_rollout_in_place[0]
    yield
    # A rollout that raises as its worker dies may do so before any other part is in.
    raised = request.node.name == "test_a_worker_lost_mid_rollout[raise]"
    if request.node.originalname in IMPORTED and not raised:  # the oracles took this path
        assert every_rollout_in_place[0] > before, "no part was recorded in place"


def _open_memfds() -> set[int]:
    """The inodes of this process's open memfds."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:envfleet-rollout"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return found


def test_shared_blocks_are_memfds_located_and_closed_when_not_kept() -> None:
    memory = Recycler(keep=1, least=0, shared=True)
    a = memory.empty((4, 8), np.float32)
    where = locate(a[1:])
    assert where is not None
    block, offset = where
    assert offset == 32 and block.size == a.nbytes
    assert os.readlink(f"/proc/self/fd/{block.fd}").startswith("/memfd:envfleet-rollout")
    b = memory.empty((4, 8), np.float32)  # another block: a is still held
    inos = {block.ino, locate(b)[0].ino}  # type: ignore[index]
    assert len(inos) == 2 and inos <= _open_memfds()
    del a, b
    gc.collect()
    kept = inos & _open_memfds()
    assert len(kept) == 1  # keep=1: the other block's descriptor is closed
    c = memory.empty((4, 8), np.float32)
    assert {locate(c)[0].ino} == kept  # type: ignore[index]  # the kept block, used again
    del c
    gc.collect()
    memory.clear()
    assert not inos & _open_memfds()


def test_private_past_the_most_shared_blocks_and_below_least() -> None:
    memory = Recycler(keep=0, least=64, shared=True)
    assert locate(memory.empty(8, np.uint8)) is None  # below least: plain np.empty
    held = [memory.empty(64, np.uint8) for _ in range(recycling.SHARED_MOST)]
    assert all(locate(a) is not None for a in held)
    assert locate(memory.empty(64, np.uint8)) is None  # one more: private
    del held
    gc.collect()
    assert locate(memory.empty(64, np.uint8)) is not None


def _child_writes(ref: object) -> None:
    """Fill each array ``ref`` names with its position + 1 (an error exits non-zero)."""
    for k, view in enumerate(recorded_views(ref)):  # type: ignore[arg-type]
        view[...] = k + 1


def test_another_process_writes_the_columns_a_ref_names() -> None:
    memory = Recycler(least=0, shared=True)
    block = memory.empty(1 << 12, np.uint8)
    field = block[:1024].view(np.float32).reshape(16, 16)
    flags = block[2048 : 2048 + 64].view(np.bool_).reshape(16, 4)
    columns = [field[:, 4:8], flags[:, 1:3]]  # a part's columns: strided views
    field[...] = 0
    flags[...] = False
    ref = record_ref(columns)
    assert ref is not None
    ctx = multiprocessing.get_context("spawn")
    # No Event: a spawned child's semaphores are named in /dev/shm, which the other tests'
    # leak checks watch; its exit status says it wrote.
    child = ctx.Process(target=_child_writes, args=(ref,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert (field[:, 4:8] == 1).all() and (field[:, :4] == 0).all() and (field[:, 8:] == 0).all()
    assert flags[:, 1:3].all() and not flags[:, 0].any() and not flags[:, 3].any()
    assert record_ref([field, np.zeros(3)]) is None  # not all in one shared block


def test_a_worker_unmaps_the_blocks_its_pool_closed() -> None:
    """Mapping a new block forgets the mappings of blocks whose descriptor the pool closed
    (they would keep the memory), and keeps the live ones."""
    memory = Recycler(keep=0, least=0, shared=True)
    first, second = memory.empty(4096, np.uint8), memory.empty(4096, np.uint8)
    refs = [record_ref([first]), record_ref([second])]
    assert refs[0] is not None and refs[1] is not None
    for ref in refs:
        recorded_views(ref)
    assert len(shared_records._MAPPED) >= 2
    keys = {(r.pid, r.fd, r.ino, r.size) for r in refs}
    del first  # keep=0: its descriptor is closed
    gc.collect()
    third = memory.empty(4096, np.uint8)
    ref = record_ref([third])
    assert ref is not None
    recorded_views(ref)
    mapped = set(shared_records._MAPPED)
    gone = (refs[0].pid, refs[0].fd, refs[0].ino, refs[0].size)
    assert gone not in mapped and (keys - {gone}) <= mapped
    memory.clear()


def test_a_ref_to_another_block_is_refused() -> None:
    memory = Recycler(least=0, shared=True)
    a = memory.empty(256, np.uint8)
    ref = record_ref([a])
    assert ref is not None
    wrong = type(ref)(ref.pid, ref.fd, ref.ino + 1, ref.size, ref.leaves)
    with pytest.raises(OSError, match="not the pool's block"):
        recorded_views(wrong)


def test_a_large_rollout_goes_in_place_bit_identical_to_serial(
    every_rollout_in_place: list[int],
) -> None:
    """A rollout of a million bytes (past the default LEAST as well), on 2 workers: each part
    recorded in place, the same values as the serial backend's, and the pool's memory used
    again by the next rollout once the last one is dropped."""
    before = every_rollout_in_place[0]
    with (
        envfleet.make("CartPole-v1", 64, backend="process", num_workers=2, seed=3) as pool,
        envfleet.make("CartPole-v1", 64, backend="serial", seed=3) as ref,
    ):
        pool.reset(seed=3)
        ref.reset(seed=3)
        blocks: set[int] = set()
        kept: list[np.ndarray] = []
        fields = ("observations", "actions", "rewards", "terminations", "truncations")
        for _ in range(3):
            got = pool.rollout(envfleet.RandomPolicy(pool.single_action_space, 7), 512)
            want = ref.rollout(envfleet.RandomPolicy(ref.single_action_space, 7), 512)
            for name in fields:
                ours, theirs = getattr(got, name), getattr(want, name)
                assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), name
            np.testing.assert_array_equal(got.final_observations, want.final_observations)
            where = locate(got.observations)
            assert where is not None
            blocks.add(where[0].ino)
            # What a caller keeps of a rollout but its observations is its own memory: keeping
            # the rewards does not keep the block from the next rollouts.
            assert all(locate(getattr(got, name)) is None for name in fields[1:])
            kept.append(got.rewards)
            del got
        assert len(blocks) <= 2  # dropped rollouts' blocks are used again
    assert every_rollout_in_place[0] - before == 6
