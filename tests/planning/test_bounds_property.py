"""Numbers a reviewer can trust, on random instances (hypothesis): the lower bound bounds every
plan and every baseline, and the plan is never slower than a baseline (every baseline is a
candidate priced by the same simulator).

Instances: layer stacks (``nn.Sequential`` of ``Linear`` / ``ReLU`` of random widths, plain —
data parallelism only — or nested, so its items are blocks pipelines can cut) and tiny HF
configs (Llama, Mixtral for expert parallelism); emulated clusters (random speeds, memory, one
node or one per device) and catalog clusters (a few device kinds, 1–8 devices on 1–3 nodes); every
non-empty set of forms (sharded data parallelism and its ``even_fsdp`` baseline among them);
random batch, precision, optimizer and micro-batch limit.  Each model shape is traced once.
"""

from __future__ import annotations

import functools
import itertools
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from torch import nn

import fxpar
from fxpar.errors import ConfigError, InfeasibleError
from fxpar.models import PRESETS
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.solvers import plan as solve
from fxpar.solvers.bounds import bucket_allreduces_s
from fxpar.solvers.problems import build_problems
from fxpar.tracing import trace
from fxpar.workload import Workload

FORM_SETS = [s for n in (1, 2, 3, 4) for s in itertools.combinations(
    ("data_parallel", "pipeline", "expert_parallel", "sharded_data_parallel"), n)]
#: the former failures were found with these (before sharded data parallelism was a form)
THREE = ("data_parallel", "pipeline", "expert_parallel")
KINDS = ("A100-SXM-80GB", "V100-SXM2-16GB", "T4", "RTX-4090", "H100-SXM")
HF = ("llama-tiny", "mixtral-tiny")
EXAMPLES = 200
REL = 1e-9
TRIED: dict[str, list[int]] = {}


@functools.cache
def stack_graph(widths: tuple[int, ...], nested: bool):
    """A Linear / ReLU stack of ``widths`` (traced once per shape)."""
    with torch.device("meta"):
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1]
        model = nn.Sequential(nn.Sequential(*layers)) if nested else nn.Sequential(*layers)
    return trace(model, (torch.randn(1, widths[0], device="meta"),), model_name=f"stack{list(widths)}")


@functools.cache
def hf_graph(name: str, seq_len: int):
    return trace_spec(PRESETS[name], Workload(global_batch=1, seq_len=seq_len))


@st.composite
def clusters(draw) -> tuple:
    """A compact cluster description (what hypothesis prints): ("emulated", speeds, memory GiB,
    inter-node Gb/s, one node) or ("catalog", inter-node Gb/s, ((kind, count, intra GB/s), ...))."""
    if draw(st.booleans()):
        speeds = tuple(draw(st.lists(st.sampled_from((0.25, 0.5, 0.8, 1.0)), min_size=1, max_size=8)))
        return ("emulated", speeds, draw(st.sampled_from((0.05, 0.5, 8.0))),
                draw(st.sampled_from((1.0, 10.0, 100.0))), draw(st.booleans()))
    nodes, total = [], 0
    for _ in range(draw(st.integers(1, 3))):
        count = draw(st.integers(1, 8 - total)) if total < 8 else 0
        if count:
            nodes.append((draw(st.sampled_from(KINDS)), count, draw(st.sampled_from((16, 300)))))
            total += count
    return ("catalog", draw(st.sampled_from((1.25, 12.5, 50))), tuple(nodes))


@functools.cache
def build_cluster(spec: tuple) -> fxpar.Cluster:
    if spec[0] == "emulated":
        _, speeds, memory, inter, one_node = spec
        return fxpar.Cluster.emulated(list(speeds), memory_gib=memory, inter_node_gbps=inter, one_node=one_node)
    _, inter, nodes = spec
    return fxpar.Cluster.from_dict({"inter_node_gbps": inter, "nodes": [
        {"gpu": kind, "count": count, "intra_node_gbps": intra} for kind, count, intra in nodes]})


@st.composite
def instances(draw) -> tuple:
    """(model, cluster, workload, forms), each compact: model ("hf", preset) or ("stack",
    widths, nested); cluster as :func:`clusters` — module docstring."""
    cluster = draw(clusters())
    world = build_cluster(cluster).world_size
    if draw(st.integers(0, 3)) == 0:
        model, seq = ("hf", draw(st.sampled_from(HF))), 16
    else:
        widths = tuple(draw(st.lists(st.sampled_from((64, 512, 2048, 4096)), min_size=2, max_size=5)))
        model, seq = ("stack", widths, draw(st.booleans())), None
    workload = Workload(global_batch=draw(st.integers(world, 16 * world + 16)), seq_len=seq,
                        dtype="fp32" if cluster[0] == "emulated" else draw(st.sampled_from(("fp32", "fp16"))),
                        optimizer=draw(st.sampled_from(("adam", "sgd"))),
                        max_microbatches=draw(st.sampled_from((None, 2, 8))))
    return model, cluster, workload, draw(st.sampled_from(FORM_SETS))


def graph_of(model: tuple):
    return hf_graph(model[1], 16) if model[0] == "hf" else stack_graph(model[1], model[2])


PLANS: dict = {}
#: instances the former bound (the whole all-reduce added) fails, at 0.86 and 0.88 x: the simulator
#: overlaps the all-reduce with the backward in 25 MiB buckets
FORMER_FAILURES = [
    # (CPU ranks do not overlap the all-reduce with compute, so these are GPUs that do; the
    # all-reduce the backward hides must outlast the optimizer step the former bound left out —
    # 80 bytes a parameter at the V100's bandwidth: a 100 Gb/s link between the two nodes — and
    # the backward must be long enough to hide it: four thousand samples)
    (("stack", (4096, 4096, 4096, 4096), False),
     ("catalog", 100.0, (("A100-SXM-80GB", 1, 300), ("V100-SXM2-16GB", 1, 300))), Workload(global_batch=4096), THREE),
    (("stack", (512, 2048, 4096, 4096, 4096), False),
     ("catalog", 100.0, (("A100-SXM-80GB", 1, 300), ("V100-SXM2-16GB", 1, 300))),
     Workload(global_batch=4096, max_microbatches=2), THREE),
]


def planned(model, cluster, workload, forms):
    """The plan, or None where nothing fits (both tests draw the same instances: each is planned once)."""
    key = (model, cluster, workload, forms)
    if key not in PLANS:
        try:
            PLANS[key] = solve(graph_of(model), build_cluster(cluster), workload, forms=forms)
        except (InfeasibleError, ConfigError):
            PLANS[key] = None
    return PLANS[key]


def _check(test: str, instance, check) -> None:
    plan = planned(*instance)
    counts = TRIED.setdefault(test, [0, 0])
    counts[0] += 1
    if plan is not None:
        counts[1] += 1
        check(plan)


def _report(test: str, start: float) -> None:
    tried, planned_ = TRIED.get(test, [0, 0])
    print(f"\n{test}: {tried} instances tried ({planned_} with a plan, the rest infeasible) "
          f"in {time.perf_counter() - start:.1f} s")


def _baselines(plan) -> dict[str, float]:
    return {name: value for name, value in plan.baselines if value is not None}


@pytest.fixture(scope="module", autouse=True)
def _deterministic():
    torch.manual_seed(0)


def _random_instances(check):
    """The same hypothesis instances for every property: seed 3, the pinned former failures."""
    for pinned in reversed(FORMER_FAILURES[:2]):
        check = example(pinned)(check)
    check = given(instances())(check)
    check = settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(check)
    return seed(3)(check)


@_random_instances
def _lower_bound_holds(instance):
    def check(plan):
        assert plan.lower_bound_s > 0
        assert plan.lower_bound_s <= plan.predicted_step_s * (1 + REL), (instance, plan.explain)
        for name, value in _baselines(plan).items():
            assert plan.lower_bound_s <= value * (1 + REL), (name, instance, plan.explain)
    _check("lower bound <= plan and every baseline", instance, check)


@_random_instances
def _never_slower_than_a_baseline(instance):
    def check(plan):
        for name, value in _baselines(plan).items():
            assert plan.predicted_step_s <= value * (1 + REL), (name, value, instance, plan.explain)
    _check("plan <= every baseline", instance, check)


@pytest.mark.full  # hypothesis over random instances; the fixed former failures stay quick
def test_lower_bound_holds_on_random_instances():
    start = time.perf_counter()
    _lower_bound_holds()
    _report("lower bound <= plan and every baseline", start)
    assert TRIED["lower bound <= plan and every baseline"][1] >= EXAMPLES // 3


@pytest.mark.full
def test_plan_is_never_slower_than_a_baseline_on_random_instances():
    start = time.perf_counter()
    _never_slower_than_a_baseline()
    _report("plan <= every baseline", start)
    assert TRIED["plan <= every baseline"][1] >= EXAMPLES // 3


def test_lower_bound_of_a_linear_stack_with_overlapped_all_reduce():
    # issue #15: three 4096-wide Linear layers on speeds (1, 0.5), batch 16 — the bound once
    # added the whole all-reduce, which the simulator overlaps with the backward in buckets
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 4096))
    graph = trace(model, (torch.randn(1, 4096, device="meta"),), model_name="three-linear")
    # (the weights read once per micro-batch, compute is a third of the step: the gap left is the
    # all-reduce priced above its physical bound, and at most one sample of the slower rank)
    # (data parallelism's bound and plan: the optimizer, a third of the step, makes ZeRO's plan
    # the faster one here, whose bound has no all-reduce to compare with)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    plan = solve(graph, cluster, Workload(global_batch=16), forms=("data_parallel",))
    cost = CostModel(graph, cluster)
    assert plan.lower_bound_s <= plan.predicted_step_s
    slack = cost.allreduce_s(cost.gradient_wire_bytes()) - sum(bucket_allreduces_s(cost))
    one_sample = max(cost.sample_cost(g).total_s for g in cluster.groups())
    assert plan.predicted_step_s - plan.lower_bound_s <= slack + one_sample


@pytest.mark.parametrize("instance", FORMER_FAILURES)
def test_the_former_bound_fails_these_instances_and_the_new_one_holds(instance):
    model, cluster, workload, forms = instance
    plan = planned(*instance)
    p = build_problems(graph_of(model), build_cluster(cluster), workload, forms)
    former = (workload.global_batch / sum(g.count / g.sample_s for g in p.dp.groups)
              + p.cost.allreduce_lower_bound_s(p.cost.gradient_bytes()))
    assert plan.form == "data_parallel" and [f for f, _ in p.lower_bound_by_form] == ["data_parallel"]
    assert plan.predicted_step_s < 0.95 * former
    assert plan.lower_bound_s <= plan.predicted_step_s
