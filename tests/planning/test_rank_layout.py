"""One answer to "where does this rank sit" (:mod:`fxpar.rank_layout`), for every parallel form,
from the plan alone; the pipeline runtime's placement reads the same rule."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, interleaved_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.errors import PlanError
from fxpar.rank_layout import RankLayout
from fxpar.tracing.hf import ModelSpec, build_model

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=128,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
MIXTRAL = dict(LLAMA, model_type="mixtral", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


@functools.cache
def model(config: str):
    return build_model(ModelSpec(hf_config=LLAMA if config == "llama" else MIXTRAL), device="meta",
                       attn_implementation="eager")


def test_data_and_sharded_parallelism_make_every_rank_its_own_replica():
    cluster = fxpar.Cluster.emulated([1.0, 0.5, 0.5])
    plan = sharded_data_parallel_plan(cluster, batch_split=[4, 2, 2], state_split=[2, 1, 1])
    places = RankLayout(plan).places
    assert [p.replica for p in places] == [0, 1, 2] and all(p.position == 0 for p in places)
    assert [p.tensor_group for p in places] == [(0,), (1,), (2,)]
    assert all(p.replica_group == (0, 1, 2) for p in places)
    assert [(p.batch_share, p.state_weight) for p in places] == [(4, 2), (2, 1), (2, 1)]


def test_tensor_parallel_groups_and_their_replicas():
    cluster = fxpar.Cluster.emulated([1.0] * 4)
    plan = tensor_parallel_plan(model("llama"), cluster, global_batch=4, kv_shares=[3, 1], replicas=2)
    places = RankLayout(plan).places
    assert [(p.replica, p.position) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.tensor_group for p in places] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [p.replica_group for p in places] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [p.heads for p in places] == [3, 1, 3, 1]


def test_expert_parallelism_gives_each_rank_its_expert_range():
    plan = expert_parallel_plan(model("mixtral"), fxpar.Cluster.emulated([1.0, 0.5]), global_batch=4,
                                expert_split=[3, 1])
    assert [p.experts for p in RankLayout(plan).places] == [(0, 3), (3, 4)]


@pytest.mark.parametrize("widths", [[2, 1], [1, 2]])
def test_a_pipeline_of_tensor_parallel_stages_places_each_rank_by_its_stage_listing(widths):
    """The run-time queries (the pipeline module makes its groups of them) agree with each rank's
    place, and with the plan's replica-major listing read directly."""
    cluster = fxpar.Cluster.emulated([1.0] * 6)
    plan = pipeline_plan(model("llama"), cluster, global_batch=4, blocks_per_stage=[2, 2], num_microbatches=2,
                         pipelines=2, tensor_parallel=widths)
    layout = RankLayout(plan)
    assert layout.replicas == 2 and layout.widths == tuple(widths) and layout.tensor_parallel
    for rank in range(6):
        p = layout.where(rank)
        (stage,) = p.stages
        u = widths[stage]
        listed = plan.stages[stage].ranks
        assert listed[p.replica * u + p.position] == rank
        assert p.tensor_group == layout.tensor_group(stage, p.replica) == tuple(listed[p.replica * u:(p.replica + 1) * u])
        assert p.replica_group == layout.replica_group(stage, p.position) == (listed[p.position], listed[u + p.position])
        assert p.pipeline == layout.pipeline(p.replica)
        assert layout.chain(p.replica) == tuple(plan.stages[j].ranks[p.replica * widths[j]] for j in range(2))
        assert (layout.lead(stage, p.replica) == rank) == (p.position == 0)
    with pytest.raises(PlanError, match="rank 6"):
        layout.where(6)


def test_an_interleaved_rank_runs_several_stages_and_explain_prints_the_layout():
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = interleaved_plan(model("llama"), cluster, global_batch=4, blocks_per_stage=[1, 1, 1, 1],
                            stage_ranks=[0, 1, 0, 1], num_microbatches=2)
    layout = RankLayout(plan)
    assert [p.stages for p in layout.places] == [(0, 2), (1, 3)]
    assert all(p.pipeline == (0, 1) for p in layout.places)
    assert layout.stage_positions(0) == (0, 1, 0, 1)
    lines = layout.lines()
    assert lines[0].split()[:3] == ["rank", "device", "stage"] and lines[2].split()[2] == "0,2"


def test_two_interleaved_pipelines_place_their_stages_alike_or_the_plan_is_refused():
    cluster = fxpar.Cluster.emulated([1.0, 0.5, 1.0, 0.5])
    plan = interleaved_plan(model("llama"), cluster, global_batch=4, blocks_per_stage=[1, 1, 1, 1],
                            stage_ranks=[0, 1, 0, 1], num_microbatches=2, pipelines=2)
    layout = RankLayout(plan)
    assert layout.stage_positions(0) == layout.stage_positions(1) == (0, 1, 0, 1)
    assert [p.pipeline for p in layout.places] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert layout.replica_group(0, 0) == (0, 2) and layout.replica_group(1, 0) == (1, 3)
    crossed = [dataclasses.replace(st, ranks=(st.ranks[0], 5 - st.ranks[1])) for st in plan.stages]
    with pytest.raises(PlanError, match="place its stages alike"):
        dataclasses.replace(plan, stages=tuple(crossed))


def test_a_plans_process_groups_are_the_layouts_rank_sets_once_per_kind():
    """What :class:`~fxpar.runtime.plan_groups.PlanGroups` makes (every rank alike, in order) is
    the layout's rank sets, a set made once per kind; asking for a group never made names the
    call that makes it."""
    from fxpar.runtime.plan_groups import PlanGroups
    from fxpar.errors import RuntimeSetupError

    plan = pipeline_plan(model("llama"), fxpar.Cluster.emulated([1.0] * 6), global_batch=4,
                         blocks_per_stage=[2, 2], num_microbatches=2, pipelines=2, tensor_parallel=[2, 1])
    assert [st.ranks for st in plan.stages] == [(0, 1, 3, 4), (2, 5)]   # pipeline p: ranks 3p .. 3p+2
    groups = PlanGroups(RankLayout(plan))
    assert groups.rank_sets("tensor") == [(0, 1), (3, 4), (2,), (5,)]
    assert groups.rank_sets("replica") == [(0, 3), (1, 4), (2, 5)]
    assert groups.rank_sets("chain") == [(0, 2), (3, 5)]
    assert groups.rank_sets("whole_replica") == [(0, 1, 2), (3, 4, 5)]
    inter = interleaved_plan(model("llama"), fxpar.Cluster.emulated([1.0, 0.5, 1.0, 0.5]), global_batch=4,
                             blocks_per_stage=[1, 1, 1, 1], stage_ranks=[0, 1, 0, 1], num_microbatches=2, pipelines=2)
    sets = PlanGroups(RankLayout(inter)).rank_sets("replica")
    assert sets == [(0, 2), (1, 3), (0, 2), (1, 3)]   # two stages per position: made once each
    with pytest.raises(RuntimeSetupError, match=r"make\('tensor'\)"):
        groups.tensor(0, 0)
    assert len(groups.rank_sets("chain")) == 2
    with pytest.raises(ValueError, match="kind 'stage'"):
        groups.rank_sets("stage")
    assert groups.rank_sets("reduce") == groups.rank_sets("replica")   # a second group over each
    with pytest.raises(ValueError, match="make_sets takes one of"):
        groups.make_sets("tensor", [(0, 1)])   # the layout's kinds come from the layout alone


def test_a_large_layout_prints_its_first_and_last_ranks():
    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0] * 40), batch_split=[1] * 40, state_split=[1] * 40)
    lines = RankLayout(plan).lines(limit=24)
    assert len(lines) == 2 + 24 + 1 and "16 more ranks" in lines[14]
