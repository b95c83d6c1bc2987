"""The lower bound's communication term (issue #37 item 3; :func:`fxpar.solvers.bounds.lower_bound_s`)
against hand-written plans of every form, not only the solver's candidates.

Instances (hypothesis): a tiny Llama (4 blocks) or Mixtral (4 experts) and a hand plan of one
form — data parallel (random shares and micro-batches), tensor parallel (width 2, replicas),
pipelines (1F1B / GPipe, 1–4 stages, tensor-parallel stages, replicas, ZeRO-1, either layout),
interleaved pipelines, expert parallel (random experts and shares), sharded data parallel
(ZeRO-2 / ZeRO-3, uneven state, checkpointing, optimizer offload) — on a cluster of exactly
the ranks it needs: GPUs of the catalog on 1–3 nodes, emulated CPU ranks (which do not overlap
communication), or one calibrated GPU kind whose measured links are faster than its declared
ones; GPUs in fp32 or fp16.  Each form's own bound must stay under ``fxpar.predict``'s step of the plan, and grow
when the links slow down (its communication term is positive on more than one rank).  Where
memory rules data parallelism out, the planner's bound keeps the other forms'
communication: it is above the compute-only bound and under every hand plan that fits.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import fxpar
from fxpar.forms.hand_plans import expert_parallel_plan, interleaved_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.profiling.database import LinkCost, ProfileDB
from fxpar.solvers import plan as solve
from fxpar.solvers.bound_work import compute_bound_s
from fxpar.solvers.bounds import form_bounds_s
from fxpar.solvers.problems import build_problems
from fxpar.tracing.hf import ModelSpec, build_model
from fxpar.workload import Workload

REL = 1e-9
SEQ = 16
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                    num_local_experts=4, num_experts_per_tok=2),
}
KINDS = ("A100-SXM-80GB", "V100-SXM2-16GB", "T4", "RTX-4090")
#: a GPU kind whose links a calibration measured (custom: the catalog's A100 otherwise)
GPU = dict(fp32_tflops=19.5, fp16_tflops=312, memory_gib=80, memory_gbps=2039, scaleup_gbps=300.0, pcie_gbps=32.0)


@functools.cache
def model(name: str):
    return build_model(ModelSpec(hf_config=CONFIGS[name]), device="meta", attn_implementation="eager")


@functools.cache
def graph(name: str):
    return trace_spec(ModelSpec(hf_config=CONFIGS[name]), Workload(global_batch=2, seq_len=SEQ))


def build_cluster(spec: tuple, factor: float = 1.0) -> fxpar.Cluster:
    """``spec``: ("gpu", inter Gb/s, ((kind, count, intra GB/s), ...)), ("cpu", inter Gb/s,
    ((speeds, ...), ...)) or ("calibrated", n, overlap); every link ``factor`` times faster."""
    if spec[0] == "gpu":
        nodes = [{"gpu": k, "count": c, "intra_node_gbps": i * factor, "host_memory_gib": 512} for k, c, i in spec[2]]
        return fxpar.Cluster.from_dict({"inter_node_gbps": spec[1] * factor, "nodes": nodes})
    if spec[0] == "cpu":
        nodes = [{"gpu": "cpu", "count": len(s), "speeds": list(s), "intra_node_gbps": 5.0 * factor} for s in spec[2]]
        return fxpar.Cluster.from_dict({"inter_node_gbps": spec[1] * factor, "nodes": nodes})
    return fxpar.Cluster.from_dict({"device_types": {"G": GPU}, "inter_node_gbps": 25.0 * factor,
                                    "nodes": [{"gpu": "G", "count": spec[1], "host_memory_gib": 512}]})


def profiles_of(spec: tuple) -> dict | None:
    """A calibrated cluster's profile: every collective measured on its ranks, faster than the
    declared links, one point faster still (the bound must follow the fastest)."""
    if spec[0] != "calibrated":
        return None
    link = LinkCost(alpha_s=2e-5, bus_bytes_per_s=900e9, world=spec[1], points=((4096.0, 1e-6), (2**20, 2e-6)))
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
    return {"G": ProfileDB(device_type="G", links={k: link for k in kinds}, overlap=spec[2])}


@st.composite
def clusters(draw, n: int) -> tuple:
    """A cluster of exactly ``n`` ranks (:func:`build_cluster`'s spec)."""
    kind = draw(st.sampled_from(("gpu", "cpu", "calibrated")))
    if kind == "calibrated":
        return ("calibrated", n, draw(st.booleans()))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    counts = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    inter = draw(st.sampled_from((1.25, 10.0, 100.0)))
    if kind == "cpu":
        return ("cpu", inter, tuple(tuple(draw(st.sampled_from((0.25, 0.5, 1.0))) for _ in range(c)) for c in counts))
    return ("gpu", inter, tuple((draw(st.sampled_from(KINDS)), c, draw(st.sampled_from((16, 300)))) for c in counts))


def composition(draw, total: int, parts: int, least: int = 1) -> list[int]:
    """``parts`` numbers ≥ ``least`` summing to ``total``."""
    cuts = sorted(draw(st.lists(st.integers(0, total - parts * least), min_size=parts - 1, max_size=parts - 1)))
    return [b - a + least for a, b in zip([0] + cuts, cuts + [total - parts * least])]


def data_parallel_plan(cluster, shares: list[int], micro: list[int], form: str = "data_parallel") -> Plan:
    """Data parallelism with ``shares[r]`` samples on rank ``r`` in micro-batches of ``micro[r]``."""
    ranks = tuple(RankPlan(rank=d.rank, device=d.type.name, node=d.node, speed=float(d.speed), batch_share=s,
                           micro_batch_size=m, num_microbatches=-(-s // m), predicted_busy_s=0.0,
                           predicted_memory_bytes=0, memory_capacity_bytes=int(d.memory_bytes))
                  for d, s, m in zip(cluster.devices, shares, micro))
    stage = StagePlan(index=0, modules=("",), ranks=tuple(range(cluster.world_size)), data_split=tuple(shares))
    return Plan(form=form, model="LlamaForCausalLM", cluster=cluster.name, global_batch=sum(shares),
                seq_len=SEQ, dtype="fp32", optimizer="adamw", stages=(stage,), ranks=ranks, predicted_step_s=0.0,
                predicted_compute_s=0.0, predicted_comm_s=0.0, lower_bound_s=0.0)


@st.composite
def pipeline_shape(draw) -> dict:
    S = draw(st.integers(1, 4))
    widths = [draw(st.sampled_from((1, 1, 2))) for _ in range(S)]
    P = draw(st.sampled_from((1, 2) if sum(widths) <= 4 else (1,)))
    m = draw(st.sampled_from((1, 2, 4)))
    return dict(blocks_per_stage=composition(draw, 4, S), tensor_parallel=widths, pipelines=P, num_microbatches=m,
                global_batch=P * m * draw(st.integers(1, 3)),
                # torch's 1F1B needs a micro-batch per stage in flight (plan_checks refuses fewer)
                schedule=draw(st.sampled_from(("1F1B", "GPipe") if m >= S else ("GPipe",))),
                zero_sharded_optimizer=draw(st.booleans()),
                layout=draw(st.sampled_from(("pipeline-major", "stage-major"))))


@st.composite
def interleaved_shape(draw) -> dict:
    W, S = draw(st.sampled_from(((2, 3), (2, 4), (3, 4))))
    ranks = draw(st.lists(st.integers(0, W - 1), min_size=S, max_size=S).filter(
        lambda r: set(r) == set(range(W)) and all(a != b for a, b in zip(r, r[1:]))))
    P, m = draw(st.sampled_from((1, 2))), draw(st.sampled_from((1, 2, 4)))
    return dict(blocks_per_stage=composition(draw, 4, S), stage_ranks=ranks, pipelines=P, num_microbatches=m,
                global_batch=P * m * draw(st.integers(1, 3)))


@st.composite
def hand_plans(draw) -> tuple:
    """(model name, cluster spec, plan builder's name, its keyword arguments) — compact for
    hypothesis to print; :func:`make_plan` builds the plan."""
    form = draw(st.sampled_from(("data_parallel", "tensor_parallel", "pipeline", "interleaved",
                                   "expert_parallel", "sharded_data_parallel")))
    if form == "pipeline":
        kw = draw(pipeline_shape())
        n = kw["pipelines"] * sum(kw["tensor_parallel"])
    elif form == "interleaved":
        kw = draw(interleaved_shape())
        n = kw["pipelines"] * (max(kw["stage_ranks"]) + 1)
    elif form == "tensor_parallel":
        n = 2 * draw(st.integers(1, 3))
        shares = composition(draw, draw(st.integers(n // 2, 12)), n // 2)
        kw = dict(global_batch=sum(shares), kv_shares=[1, 1], replicas=n // 2, batch_shares=shares, seq_len=SEQ)
    else:
        n = draw(st.integers(1 if form == "data_parallel" else 2, 6))
        m = draw(st.sampled_from((1, 2)))
        shares = composition(draw, draw(st.integers(n * m, 6 * n * m)), n, least=m)
        if form == "data_parallel":
            kw = dict(shares=shares, micro=[draw(st.integers(1, s)) for s in shares])
        elif form == "expert_parallel":
            kw = dict(global_batch=sum(shares), expert_split=composition(draw, 4, n, least=0), batch_shares=shares,
                      num_microbatches=m, seq_len=SEQ)
        else:
            kw = dict(batch_split=shares, state_split=[draw(st.integers(1, 3)) for _ in range(n)],
                      shard_stage=draw(st.sampled_from((2, 3))), micro_batch_size=draw(st.integers(1, 4)),
                      activation_checkpointing=[draw(st.booleans()) for _ in range(n)], seq_len=SEQ)
    cluster = draw(clusters(n))
    if form == "sharded_data_parallel" and cluster[0] != "cpu":
        kw["offload_optimizer"] = [draw(st.booleans()) for _ in range(n)]
    if cluster[0] != "cpu":  # GPUs train in fp16 too (half-precision gathers and activation all-reduces)
        kw["dtype"] = draw(st.sampled_from(("fp32", "fp16")))
    return ("mixtral" if form == "expert_parallel" else "llama"), cluster, form, kw


def make_plan(name: str, cluster, form: str, kw: dict) -> Plan:
    """The hand plan of :func:`hand_plans`' draw (in ``kw["dtype"]``, fp32 by default)."""
    kw = dict(kw)
    dtype = kw.pop("dtype", "fp32")
    if form == "data_parallel":
        plan = data_parallel_plan(cluster, **kw)
    elif form == "sharded_data_parallel":
        plan = sharded_data_parallel_plan(cluster, model=type(model(name)).__name__, **kw)
    else:
        build = {"tensor_parallel": tensor_parallel_plan, "pipeline": pipeline_plan, "interleaved": interleaved_plan,
                 "expert_parallel": expert_parallel_plan}[form]
        plan = build(model(name), cluster, seq_len=SEQ, **{k: v for k, v in kw.items() if k != "seq_len"})
    return dataclasses.replace(plan, dtype=dtype)


def form_bound(plan: Plan, name: str, spec: tuple, factor: float = 1.0) -> tuple[float, float]:
    """(the bound of the plan's own form, the plan's predicted step) on ``spec``'s cluster with
    links ``factor`` times faster."""
    cluster, profiles = build_cluster(spec, factor), profiles_of(spec)
    cost = CostModel(graph(name), cluster, dtype=plan.dtype, optimizer=plan.optimizer, profiles=profiles)
    offload = any(r.offload_optimizer for r in plan.ranks)
    bounds = form_bounds_s(cost, plan.global_batch, (plan.form,), host_optimizer=offload)
    return bounds[plan.form], fxpar.predict(plan, graph(name), cluster, profiles=profiles).step_s


def check_hand_plan(instance: tuple) -> None:
    name, spec, form, kw = instance
    plan = make_plan(name, build_cluster(spec), form, kw)
    bound, step = form_bound(plan, name, spec)
    assert 0 < bound <= step * (1 + REL), (instance, bound, step)
    if plan.world_size > 1 and spec[0] != "calibrated":  # the communication term: slower links, a larger bound
        assert form_bound(plan, name, spec, factor=1e3)[0] < bound, instance


def _hypothesis(examples: int):
    return lambda f: seed(37)(settings(max_examples=examples, deadline=None, database=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(
        given(hand_plans())(f)))


@_hypothesis(30)
def _few(instance):
    check_hand_plan(instance)


@_hypothesis(400)
def _many(instance):
    check_hand_plan(instance)


#: hand plans of every form on a memory-capped cluster (pinned; the random ones draw the rest)
PINNED = [
    ("llama", ("gpu", 1.25, (("V100-SXM2-16GB", 2, 16), ("T4", 2, 16))), "pipeline",
     dict(blocks_per_stage=[1, 2, 1], tensor_parallel=[1, 2, 1], pipelines=1, num_microbatches=4, global_batch=8,
          schedule="1F1B", zero_sharded_optimizer=False, layout="pipeline-major")),
    ("llama", ("cpu", 1.0, ((1.0, 0.5), (0.25,))), "interleaved",
     dict(blocks_per_stage=[1, 1, 2], stage_ranks=[0, 1, 2], pipelines=1, num_microbatches=2, global_batch=4)),
    ("mixtral", ("calibrated", 3, True), "expert_parallel",
     dict(global_batch=6, expert_split=[3, 0, 1], batch_shares=[4, 1, 1], num_microbatches=1, seq_len=SEQ)),
    ("llama", ("gpu", 10.0, (("A100-SXM-80GB", 1, 300), ("RTX-4090", 2, 16))), "sharded_data_parallel",
     dict(batch_split=[5, 1, 2], state_split=[3, 1, 1], shard_stage=3, micro_batch_size=2,
          activation_checkpointing=[False, True, False], offload_optimizer=[False, True, False], seq_len=SEQ)),
]


@pytest.mark.parametrize("instance", PINNED, ids=lambda i: i[2] if isinstance(i, tuple) else "")
def test_each_forms_bound_holds_for_pinned_hand_plans(instance):
    check_hand_plan(instance)


@pytest.mark.full  # the quick tier keeps the pinned plans of every form (its 300 s budget)
def test_each_forms_bound_holds_for_random_hand_plans():
    _few()


@pytest.mark.full  # 400 random hand plans (~15 s)
def test_each_forms_bound_holds_for_many_random_hand_plans():
    _many()


def capped_cluster(factor: float = 1.0) -> fxpar.Cluster:
    """4 emulated ranks on 2 nodes, each holding the tiny Llama's training state but not its
    gradient buckets and activations beside it: data parallelism does not fit, two pipeline stages
    or sharded state do."""
    state = CostModel(graph("llama"), fxpar.Cluster.emulated([1.0]), dtype="fp32", optimizer="adamw").state_bytes()
    gib = state / 2**30
    nodes = [{"gpu": "cpu", "count": 2, "speeds": [1.0, 0.5], "memory_gib": gib, "intra_node_gbps": 5.0 * factor}] * 2
    return fxpar.Cluster.from_dict({"inter_node_gbps": 1.0 * factor, "nodes": nodes})


@pytest.mark.parametrize("forms", [("data_parallel", "pipeline", "sharded_data_parallel"),
                                        ("data_parallel", "sharded_data_parallel")])
def test_memory_caps_force_a_positive_communication_term(forms):
    workload = Workload(global_batch=8, seq_len=SEQ, optimizer="adamw")
    p = build_problems(graph("llama"), capped_cluster(), workload, forms)
    fast = build_problems(graph("llama"), capped_cluster(1e3), workload, forms)
    bounded = [f for f, _ in p.lower_bound_by_form]
    assert not p.dp_fits and "data_parallel" not in bounded and bounded
    compute_only = compute_bound_s(p.cost, 8) + min(p.cost.optimizer_s(d) for d in p.cluster.devices) / 4
    assert p.lower_bound_s > fast.lower_bound_s > compute_only
    plan = solve(graph("llama"), capped_cluster(), workload, forms=forms)
    assert plan.lower_bound_s == p.lower_bound_s <= plan.predicted_step_s
    hand = [pipeline_plan(model("llama"), p.cluster, global_batch=8, blocks_per_stage=[2, 2], num_microbatches=4,
                          pipelines=2, seq_len=SEQ),
            sharded_data_parallel_plan(p.cluster, batch_split=[3, 1, 3, 1], state_split=[1] * 4, shard_stage=3,
                                       model="LlamaForCausalLM", seq_len=SEQ)]
    for q in hand:
        if q.form not in forms:
            continue
        pred = fxpar.predict(q, graph("llama"), p.cluster)
        assert max(pred.peak_memory_bytes) <= p.cluster.devices[0].memory_bytes, q.form
        assert p.lower_bound_s <= pred.step_s * (1 + REL), q.form


def test_the_pipeline_hop_term_counts_every_tensor_a_cut_sends():
    """A Llama cut sends its mask, rotary tables and labels beside the hidden state: the bound's
    thinnest cut holds them all (more than the hidden state alone), and still no more than what
    any cut's hop sends for one sample."""
    from fxpar.sim.segments import build_segments
    from fxpar.solvers.bounds import thinnest_cut_bytes

    cluster = build_cluster(("cpu", 10.0, ((1.0, 0.5),)))
    cost = CostModel(graph("llama"), cluster, dtype="fp32", optimizer="adamw")
    table = build_segments(cost.graph, cost, {g.key: g for g in cluster.groups()})
    hidden = float(table.boundary_bytes[:-1].min())
    beta = thinnest_cut_bytes(table)
    assert beta > hidden
    assert all(beta <= sum(table.hop_messages(j, 1)[0]) + 1e-9 for j in range(table.size - 1))

