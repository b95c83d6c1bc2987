"""One price for every collective (issue #37, item 1).

* No fxpar module outside the pricing modules reads a link's bandwidth or latency or the
  formulas' constants (an AST scan): every form's communication is priced by
  :mod:`fxpar.profiling.network` on :mod:`fxpar.profiling.collectives`' formulas.
* Scaling every link's bandwidth by 2, with the per-call latencies at 0, halves every form's
  communication term exactly (each is a sum or max of ``bytes / bandwidth`` terms).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fxpar
import fxpar.solvers
from fxpar.cluster import Cluster
from fxpar.forms.hand_plans import expert_parallel_plan, pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.planning import trace_spec
from fxpar.profiling import collectives
from fxpar.profiling.database import ProfileDB
from fxpar.tracing.hf import ModelSpec, build_model
from fxpar.workload import Workload
from tests.workers import TINY_CONFIGS

PACKAGE = Path(fxpar.__file__).resolve().parent
#: where links are priced, and where they are declared or measured (not priced)
ALLOWED = {
    "profiling/collectives.py": "the α-β formulas",
    "profiling/network.py": "a cluster's links as one value; every form asks it for seconds",
    "profiling/database.py": "LinkCost, a calibrated link's own α-β (read by the two above)",
    "profiling/measure_comm.py": "measures links (writes LinkCost, prints what it measured)",
}
ALLOWED_DIRS = {
    "cluster/": "declares the links (device types, the NIC)",
    "calibrate/": "measures the links",
}
#: link fields and the formulas' constants
BANNED = {"intra_node_gbps", "inter_node_gbps", "inter_node_bytes_per_s", "scaleup_gbps", "pcie_gbps",
          "intra_bytes_per_s", "node_bytes_per_s", "bus_bytes_per_s", "alpha_s", "host_link_bytes_per_s",
          "LINK_EFFICIENCY", "ALPHA_INTRA_S", "ALPHA_INTER_S"}


def _reads(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in BANNED:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in BANNED:
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom):
            out += [(node.lineno, a.name) for a in node.names if a.name in BANNED]
    return out


def test_no_module_outside_the_pricing_reads_a_link():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED or any(rel.startswith(d) for d in ALLOWED_DIRS):
            continue
        found += [f"fxpar/{rel}:{line}: reads {name}" for line, name in _reads(ast.parse(path.read_text()))]
    assert not found, "price links in fxpar/profiling/network.py, not here:\n" + "\n".join(found)


def test_the_scan_sees_a_read():
    assert sorted(_reads(ast.parse("x = cluster.inter_node_bytes_per_s() / LINK_EFFICIENCY"))) == [
        (1, "LINK_EFFICIENCY"), (1, "inter_node_bytes_per_s")]


# ---- the bandwidth test ----------------------------------------------------------------------
#: a GPU whose links the test scales (the catalog's A100 otherwise)
GPU = dict(fp32_tflops=19.5, fp16_tflops=312, memory_gib=80, memory_gbps=2039)


def _cluster(device: str, factor: float) -> Cluster:
    """2 nodes of 2 devices, every link (intra-node, NIC, host) ``factor`` times the base one."""
    if device == "gpu":
        types = {"G": dict(GPU, scaleup_gbps=300.0 * factor, pcie_gbps=32.0 * factor)}
        nodes = [{"gpu": "G", "count": 2, "repeat": 2}]
    else:
        types, nodes = {}, [{"gpu": "cpu", "count": 2, "repeat": 2, "intra_node_gbps": 5.0 * factor}]
    return Cluster.from_dict({"device_types": types, "nodes": nodes, "inter_node_gbps": 25.0 * factor},
                             name=f"{device}-x{factor:g}")


def _plans(cluster: Cluster) -> dict:
    """One plan of every form that communicates on ``cluster`` (4 ranks on 2 nodes)."""
    llama = build_model(ModelSpec(hf_config=TINY_CONFIGS["llama"]), device="meta", attn_implementation="eager")
    mixtral = build_model(ModelSpec(hf_config=TINY_CONFIGS["mixtral"]), device="meta", attn_implementation="eager")
    experts = TINY_CONFIGS["mixtral"]["num_local_experts"]
    return {
        "zero3": ("llama", sharded_data_parallel_plan(cluster, batch_split=[2] * 4, state_split=[1] * 4,
                                                      shard_stage=3, model=type(llama).__name__, seq_len=SEQ)),
        "zero2": ("llama", sharded_data_parallel_plan(cluster, batch_split=[3, 1, 2, 2], state_split=[1, 2, 1, 1],
                                                      shard_stage=2, model=type(llama).__name__, seq_len=SEQ)),
        "pipeline, 2 x 2, ZeRO-1": ("llama", pipeline_plan(llama, cluster, global_batch=BATCH, blocks_per_stage=[1, 1],
                                                           num_microbatches=2, pipelines=2, seq_len=SEQ,
                                                           zero_sharded_optimizer=True)),
        "pipeline, stage-major": ("llama", pipeline_plan(llama, cluster, global_batch=BATCH, blocks_per_stage=[1, 1],
                                                         num_microbatches=2, pipelines=2, seq_len=SEQ,
                                                         layout="stage-major")),
        "pipeline of TP 2, 2 pipelines": ("llama", pipeline_plan(llama, cluster, global_batch=BATCH,
                                                                 blocks_per_stage=[2], num_microbatches=2,
                                                                 pipelines=2, seq_len=SEQ, tensor_parallel=[2])),
        "tensor parallel x 2 replicas": ("llama", tensor_parallel_plan(llama, cluster, global_batch=BATCH,
                                                                       kv_shares=[1, 1], replicas=2, seq_len=SEQ)),
        "expert parallel": ("mixtral", expert_parallel_plan(mixtral, cluster, global_batch=BATCH, seq_len=SEQ,
                                                            expert_split=[experts // 4] * 3 + [experts - 3 * (experts // 4)])),
    }


BATCH, SEQ = 8, 16


def _comm(pred) -> float:
    """The communication parts of a prediction (:class:`fxpar.predict.Prediction`)."""
    return pred.tensor_parallel_s + pred.allreduce_s + pred.gather_s + pred.alltoall_s + pred.hop_s


@pytest.mark.parametrize("device", [pytest.param("gpu", marks=pytest.mark.full), "cpu"])  # quick: the CPU cluster
def test_twice_the_bandwidth_halves_every_forms_communication(device, monkeypatch):
    """No latency (α = 0) and no overlap (the GPU's profile says so; CPU ranks have none): every
    form's communication is bytes over bandwidths, in sums and maxima, so it halves exactly."""
    monkeypatch.setattr(collectives, "ALPHA_INTRA_S", 0.0)
    monkeypatch.setattr(collectives, "ALPHA_INTER_S", 0.0)
    profiles = {"G": ProfileDB(device_type="G", overlap=False)} if device == "gpu" else None
    base, fast = _cluster(device, 1.0), _cluster(device, 2.0)
    graphs = {name: trace_spec(ModelSpec(hf_config=TINY_CONFIGS[name]), Workload(global_batch=BATCH, seq_len=SEQ))
              for name in ("llama", "mixtral")}
    dp = fxpar.solvers.plan(graphs["llama"], base, Workload(global_batch=BATCH, seq_len=SEQ),
                            forms=["data_parallel"])
    plans = {"data parallel": ("llama", dp), **_plans(base)}
    for name, (model, plan) in plans.items():
        slow = _comm(fxpar.predict(plan, graphs[model], base, profiles=profiles))
        quick = _comm(fxpar.predict(plan, graphs[model], fast, profiles=profiles))
        assert slow > 0, f"{name}: no communication priced on {base}"
        assert quick == pytest.approx(slow / 2, rel=1e-9), f"{name}: {quick} s at 2x bandwidth, {slow} s at 1x"
        # a running job's measured slow link (fxpar.adapt: Cluster.derated(link=)) prices the same way
        derated = _comm(fxpar.predict(plan, graphs[model], base.derated([1.0] * base.world_size, link=0.5),
                                      profiles=profiles))
        assert derated == pytest.approx(2 * slow, rel=1e-9), f"{name}: {derated} s at a link derated to 0.5"
