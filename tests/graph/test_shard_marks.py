"""One mark per cut parameter: :class:`fxpar.checkpoint.layout.ShardMark` (its dimension and its
:class:`~fxpar.checkpoint.layout.ShardSpec` box), and nothing else fxpar hangs on the tensor."""

from __future__ import annotations

import pytest
import torch

from fxpar.checkpoint.layout import MARK, ShardMark, ShardSpec, counted_here, mark_shard, shard_mark
from fxpar.codegen.common.shards import place, shard_spec, slice_parameter, slice_runs, take
from fxpar.codegen.tensor.module import shard_model
from tests.workers import tiny_model


def _fxpar_attributes(p: torch.Tensor) -> set[str]:
    return {name for name in vars(p) if name.startswith("fxpar")}


def test_a_plain_slice_carries_its_dimension_and_box_alone():
    full = torch.arange(24.0).reshape(6, 4)
    p = slice_parameter(full, 0, 1, 3)
    assert _fxpar_attributes(p) == {MARK}
    assert shard_mark(p) == ShardMark(dim=0, box=ShardSpec(global_shape=(6, 4), offsets=(1, 0)))
    assert torch.equal(p.detach(), full[1:3]) and counted_here(p)


@pytest.mark.parametrize("runs, sizes", [(((1, 1), (4, 1), (7, 1)), ()), (((0, 2), (6, 1)), (2, 1))])
def test_a_fused_slice_places_and_takes_back_its_pieces(runs, sizes):
    """Equal pieces of equal blocks (``slice_parameter(parts=3)``'s form) list no sizes; pieces of
    other sizes (a grouped-query ``[q | k | v]``) list theirs; either goes back into its boxes."""
    full = torch.arange(36.0).reshape(9, 4)
    p = slice_parameter(full, 0, 1, 2, parts=3) if not sizes else slice_runs(full, 0, runs)
    spec = shard_spec(p)
    assert spec == ShardSpec(global_shape=(9, 4), offsets=(runs[0][0], 0), fused_dim=0,
                             fused_offsets=tuple(o for o, _ in runs), fused_sizes=sizes)
    back = torch.zeros_like(full)
    place(back, p.detach(), spec)
    rows = [r for o, n in runs for r in range(o, o + n)]
    assert torch.equal(back[rows], full[rows]) and torch.equal(take(full, p.detach(), spec), p.detach())


def test_a_tensor_parallel_rank_marks_each_tensor_once():
    """After one rank's tensor-parallel cut (1:1 heads, no process group needed to cut), every
    parameter is a whole replica (no mark), a slice with a box, or a tensor this rank alone holds;
    none carries any other fxpar attribute."""
    model = tiny_model("llama")
    shard_model(model, [1, 1], 0)
    marks = {n: shard_mark(p) for n, p in model.named_parameters()}
    assert all(_fxpar_attributes(p) <= {MARK} for p in model.parameters())
    sliced = [n for n, m in marks.items() if m is not None and m.dim is not None]
    assert sliced and all(marks[n].box is not None for n in sliced)
    assert any(n.endswith("q_proj.weight") for n in sliced) and any(n.endswith("down_proj.weight") for n in sliced)
    assert all(marks[n] is None for n in marks if n.endswith("norm.weight"))


def test_a_mark_is_replaced_whole():
    p = torch.nn.Parameter(torch.zeros(3))
    mark_shard(p, ShardMark())
    assert counted_here(p) and shard_spec(p) is None
    mark_shard(p, ShardMark(own=False, repeated=(0, ((0, 1),))))
    assert not counted_here(p) and _fxpar_attributes(p) == {MARK}
