"""Property-based tests of everything a user writes by hand: cluster mappings, scenario files
and plan JSON.  Property: loading either succeeds (and then the object round-trips and prints),
or raises an :class:`~fxpar.errors.FxparError` with a message; never another exception.

Inputs are mostly valid with junk mixed in (wrong types, missing and unknown keys, negative and
huge numbers, NaN/inf, text where numbers go, inconsistent shares), plus free-form junk and
text mutations of YAML.  Hypothesis keeps no example database (no files in the repository).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpar.cluster import CATALOG, Cluster
from fxpar.errors import FxparError
from fxpar.plan import Plan, RankPlan, StagePlan
from fxpar.scenario import load_scenario
from fxpar.tracing.hf import hf_config

SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ----------------------------------------------------------------------------- value forms

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5),
    st.sampled_from([0, -1, 10**30, 2**21, 1.5, -2.5, 1e-320, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.text(max_size=6), st.sampled_from(["8", "1e3", "", " ", "cpu", "T4", "nan", "data_parallel"]),
    st.lists(st.integers(-2, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 2), max_size=2),
)


POSITIVE = st.floats(0.01, 1e4) | st.floats(min_value=0.0, exclude_min=True, allow_infinity=False)
SPEED = st.floats(0.1, 2.0) | st.floats(min_value=0.0, exclude_min=True, max_value=1e3)
NAME = st.text(min_size=1, max_size=6).filter(str.strip)
GPUS = sorted(set(CATALOG) - {"cpu"}) + ["h100 sxm", "MYGPU"]

# valid inputs; the tests mutate them (a few edits each) so that most inputs are almost right
custom_type = st.fixed_dictionaries(
    {"fp32_tflops": POSITIVE, "fp16_tflops": POSITIVE | st.none(), "memory_gib": POSITIVE,
     "memory_gbps": POSITIVE},
    optional={"bf16_tflops": POSITIVE, "tf32_tflops": POSITIVE, "scaleup_gbps": POSITIVE,
              "pcie_gbps": POSITIVE, "matmul_efficiency": st.floats(0.01, 1.0),
              "memory_efficiency": st.floats(0.01, 1.0),
              "vendor": st.sampled_from(["nvidia", "amd", "cpu", "custom"]), "source": NAME})
gpu_node = st.fixed_dictionaries(
    {"gpu": st.sampled_from(GPUS), "count": st.integers(1, 4)},
    optional={"repeat": st.integers(1, 3), "memory_gib": POSITIVE, "intra_node_gbps": POSITIVE})
cpu_node = st.integers(1, 4).flatmap(lambda n: st.fixed_dictionaries(
    {"gpu": st.just("cpu"), "count": st.just(n)},
    optional={"repeat": st.integers(1, 3), "memory_gib": POSITIVE,
              "speeds": st.lists(SPEED, min_size=n, max_size=n)})) | st.fixed_dictionaries(
    {"gpu": st.just("cpu"), "count": st.integers(1, 4), "speed": SPEED})
cluster_body = st.fixed_dictionaries(
    {"nodes": st.lists(gpu_node | cpu_node, min_size=1, max_size=3), "inter_node_gbps": POSITIVE,
     "device_types": st.fixed_dictionaries({"MYGPU": custom_type})},
    optional={"name": NAME})
model_section = st.fixed_dictionaries(
    {"hf_config": st.fixed_dictionaries({"model_type": st.just("gpt2"), "n_layer": st.integers(1, 4),
                                         "n_embd": st.just(64), "n_head": st.just(4)})
     | st.fixed_dictionaries({"model_type": st.just("llama"), "num_hidden_layers": st.integers(1, 4)})},
    optional={"task": st.just("causal-lm"), "name": NAME})
workload_section = st.fixed_dictionaries(
    {"global_batch": st.integers(1, 64)},
    optional={"seq_len": st.integers(1, 512), "dtype": st.sampled_from(["fp32", "fp16", "bf16"]),
              "optimizer": st.sampled_from(["adam", "adamw", "sgd"]), "max_microbatches": st.integers(1, 8)})
scenario_base = st.fixed_dictionaries(
    {"cluster": cluster_body, "model": model_section, "workload": workload_section}, optional={"name": NAME})

json_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(d: Any, path: tuple, op: str, junk: Any) -> Any:
    """A deep copy of ``d`` with ``op`` applied at ``path``."""
    d = json.loads(json.dumps(d))
    if not path:
        return junk
    parent = d
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    value = parent[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if op == "delete":
        del parent[key]
    elif op == "negate" and number:
        parent[key] = -value - 1
    elif op == "bump" and number:
        parent[key] = value + 1
    elif op == "scale" and number:
        parent[key] = value * 1e300
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, value)
    elif op == "unknown_key" and isinstance(value, dict):
        value["bogus"] = junk
    else:
        parent[key] = junk
    return d


def mutated(base: st.SearchStrategy, most: int = 2) -> st.SearchStrategy:
    """``base`` with 0..``most`` random edits: delete a key, junk a value, negate, bump or blow up a
    number, duplicate a list entry, add an unknown key."""
    @st.composite
    def build(draw: st.DrawFn) -> Any:
        d = draw(base)
        for _ in range(draw(st.integers(0, most))):
            paths = _paths(d)
            path = paths[draw(st.integers(0, len(paths) - 1))]
            op = draw(st.sampled_from(["delete", "junk", "negate", "bump", "scale", "duplicate",
                                       "unknown_key"]))
            d = _mutate(d, path, op, draw(JUNK))
        return d
    return build()


cluster_inputs = st.one_of(
    mutated(cluster_body), mutated(st.fixed_dictionaries({"cluster": cluster_body}, optional={"name": NAME})),
    json_junk)
scenario_dicts = mutated(scenario_base)

YAML_NOISE = [":", "[", "{", "}", "\t", "- ", "\n", "'", '"', "&a ", "*a", "!!python/object:os.system ",
              "%", "@", "? ", "|", ">", "---\n", "...\n", "\x00", "\ufeff"]


# ----------------------------------------------------------------------------- cluster

def _assert_clear(exc: FxparError) -> None:
    assert str(exc).strip(), f"{type(exc).__name__} without a message"


@SETTINGS
@given(cluster_inputs)
def test_cluster_mapping_loads_or_fails_clearly(data: Any) -> None:
    try:
        cluster = Cluster.from_dict(data, source="fuzz.yaml")
    except FxparError as exc:
        _assert_clear(exc)
        return
    again = Cluster.from_dict(cluster.to_dict(), source="round trip")
    assert again.world_size == cluster.world_size
    assert [(d.type, d.speed, d.memory_bytes) for d in again.devices] == \
        [(d.type, d.speed, d.memory_bytes) for d in cluster.devices]
    assert str(cluster) and cluster.groups()


# ----------------------------------------------------------------------------- scenario files

@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="fxpar-fuzz-") as d:
        yield Path(d)


@pytest.mark.full   # a property test over random scenario files (3 s); the named bad files stay quick (test_bad_inputs.py)
@SETTINGS
@given(scenario=scenario_dicts, as_json=st.booleans(), noise=st.lists(
    st.tuples(st.floats(0, 1), st.sampled_from(YAML_NOISE)), max_size=2), cut=st.none() | st.floats(0, 1))
def test_scenario_file_loads_or_fails_clearly(scratch: Path, scenario: dict, as_json: bool,
                                              noise: list, cut: float | None) -> None:
    text = json.dumps(scenario) if as_json else yaml.safe_dump(scenario, allow_unicode=True)
    for at, piece in noise:
        i = int(at * len(text))
        text = text[:i] + piece + text[i:]
    if cut is not None:
        text = text[: int(cut * len(text))]
    path = scratch / ("s.json" if as_json else "s.yaml")
    path.write_text(text, encoding="utf-8")
    try:
        loaded = load_scenario(path)
        assert loaded.cluster.world_size >= 1 and loaded.workload.global_batch >= 1
        hf_config(loaded.model)  # the model part, as far as planning reads it before tracing
    except FxparError as exc:
        _assert_clear(exc)


# ----------------------------------------------------------------------------- plans

def _ranks(n: int, shares: list[int], micro: list[int], counts: list[int]) -> list[dict]:
    return [{"rank": r, "device": "cpu", "node": r, "speed": 1.0 / (r + 1), "batch_share": shares[r],
             "micro_batch_size": micro[r], "num_microbatches": counts[r], "predicted_busy_s": 0.1 * r,
             "predicted_memory_bytes": 1000 + r, "memory_capacity_bytes": 8 << 30} for r in range(n)]


def _plan(**kw: Any) -> dict:
    solver = {"name": "dp-share-lp", "backend": "HIGHS", "status": "optimal", "objective_s": 0.9,
              "integer_s": 1.0, "gap": 0.1, "solve_time_s": 0.01}
    base = {"model": "LlamaForCausalLM", "cluster": "emulated-3", "global_batch": 12, "seq_len": 32,
            "dtype": "fp32", "optimizer": "adam", "predicted_step_s": 1.0, "predicted_compute_s": 0.8,
            "predicted_comm_s": 0.2, "lower_bound_s": 0.5, "baselines": {"even_dp": 1.5, "megatron_even": None},
            "solve_time_s": 0.01, "solver": solver, "emulated": True, "explain": ["data parallel: 1.0 s"]}
    return {**base, **kw}


def _stage(index: int, modules: list[str], ranks: list[int], split: list[int], **kw: Any) -> dict:
    return {"index": index, "modules": modules, "ranks": ranks, "data_split": split, **kw}


VALID_PLANS = {
    "data_parallel": _plan(
        form="data_parallel", ranks=_ranks(3, [6, 4, 2], [3, 2, 2], [2, 2, 1]),
        stages=[_stage(0, [""], [0, 1, 2], [6, 4, 2])]),
    "pipeline": _plan(
        form="pipeline", pipelines=2, num_microbatches=2, schedule="1F1B",
        ranks=_ranks(4, [6] * 4, [3] * 4, [2] * 4), solver=None,
        stages=[_stage(0, ["model.layers.0"], [0, 2], [6, 6], device="cpu"),
                _stage(1, ["model.layers.1"], [1, 3], [6, 6], device="cpu")]),
    "tensor_parallel": _plan(
        form="tensor_parallel", ranks=_ranks(2, [12, 12], [12, 12], [1, 1]), solver=None,
        stages=[_stage(0, [""], [0, 1], [12], tensor={"split": [3, 1]}, tensor_parallel=2)]),
}


def test_the_valid_plans_are_valid() -> None:
    for name, d in VALID_PLANS.items():
        plan = Plan.from_dict(d, source=name)
        assert Plan.from_json(plan.to_json()) == plan and plan.table()


def mutated_plans() -> st.SearchStrategy:
    """One of the valid plans with 1..3 edits."""
    return mutated(st.sampled_from(sorted(VALID_PLANS)).map(lambda k: VALID_PLANS[k]), most=3)


def _check_plan(load) -> None:
    try:
        plan = load()
    except FxparError as exc:
        _assert_clear(exc)
        return
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.table() and plan.world_size == len(plan.ranks)


@SETTINGS
@given(mutated_plans())
def test_mutated_plan_dict_loads_or_fails_clearly(d: Any) -> None:
    _check_plan(lambda: Plan.from_dict(d, source="fuzz plan"))


@SETTINGS
@given(st.one_of(json_junk.map(lambda v: json.dumps(v)), mutated_plans().map(json.dumps),
                 st.text(max_size=40)))
def test_plan_json_text_loads_or_fails_clearly(text: str) -> None:
    _check_plan(lambda: Plan.from_json(text, source="fuzz.json"))


@SETTINGS
@given(field=st.sampled_from(["batch_share", "micro_batch_size", "num_microbatches", "speed", "rank",
                              "predicted_busy_s", "device"]), value=JUNK)
def test_plan_objects_built_in_python_fail_clearly(field: str, value: Any) -> None:
    """Codegen and hand plans build RankPlan / StagePlan / Plan directly, not from JSON."""
    good = Plan.from_dict(VALID_PLANS["data_parallel"])
    ranks = [dict(_ranks(3, [6, 4, 2], [3, 2, 2], [2, 2, 1])[r]) for r in range(3)]
    ranks[1][field] = value
    try:
        plan = dataclasses.replace(good, ranks=tuple(RankPlan(**r) for r in ranks), stages=(
            StagePlan(index=0, modules=("",), ranks=(0, 1, 2), data_split=(6, 4, 2)),))
    except FxparError as exc:
        _assert_clear(exc)
        return
    assert Plan.from_json(plan.to_json()) == plan
