""":class:`fxpar.runtime.pool.WorkerPool`: the process groups a call makes end with the call, on
every rank, so a suite's later calls do not share the cores with the idle groups of earlier ones."""

from __future__ import annotations

import torch.distributed as dist

from fxpar.compat import live_process_groups


def make_groups(n: int) -> int:
    """Make ``n`` groups over every rank and one over this rank alone; the live count after."""
    kept = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(n)]
    kept.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))
    return live_process_groups()


def make_mixed_groups() -> int:
    """A plan's mix: whole-job groups, then one group per rank alone made by every rank (the
    tensor groups of width 1), then whole-job groups again; the live count after."""
    world = dist.get_world_size()
    for sizes in ([world] * 2, [1] * world, [world] * 2):
        for i, size in enumerate(sizes):
            dist.new_group([i] if size == 1 else list(range(world)))
    return live_process_groups()


def count_groups() -> int:
    return live_process_groups()


def test_a_calls_process_groups_end_with_it(pool2):
    before = pool2.run(count_groups)
    assert pool2.run(make_groups, 5) == [b + 6 for b in before]
    assert pool2.run(count_groups) == before     # the next call finds none of them
    assert pool2.run(make_groups, 1) == [b + 2 for b in before]   # and can make groups again


def test_calls_that_each_make_groups_of_one_rank_and_of_all_go_on_making_them(pool2):
    """Destroyed in creation order, a whole-job group destroyed while a one-rank group lived made a
    later call's ``new_group`` fail in gloo's connectFullMesh in about 1 call of 20 (measured:
    :func:`fxpar.runtime.group_lifetime.destroy_groups`); the smallest first, none does."""
    before = pool2.run(count_groups)
    for _ in range(12):
        assert pool2.run(make_mixed_groups) == [b + 5 for b in before]
    assert pool2.run(count_groups) == before
