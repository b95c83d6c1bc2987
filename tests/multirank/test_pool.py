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


def count_groups() -> int:
    return live_process_groups()


def test_a_calls_process_groups_end_with_it(pool2):
    before = pool2.run(count_groups)
    assert pool2.run(make_groups, 5) == [b + 6 for b in before]
    assert pool2.run(count_groups) == before     # the next call finds none of them
    assert pool2.run(make_groups, 1) == [b + 2 for b in before]   # and can make groups again
