"""Host memory is planned: cluster files carry ``host_memory_gib`` per node, every rank's plan
says what it holds on the host while it sets up, and a node that cannot hold it is refused."""

from __future__ import annotations

import pytest
import torch

from fxpar.cluster import Cluster
from fxpar.errors import InfeasibleError
from fxpar.plan import Plan
from fxpar.solvers import plan as solve
from fxpar.solvers.host_memory import staging_bytes
from fxpar.tracing import trace
from fxpar.workload import Workload


def _graph():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    return trace(model, (torch.randn(1, 256),))


def _cluster(host_gib: float | None) -> Cluster:
    node = {"gpu": "T4", "count": 2}
    if host_gib is not None:
        node["host_memory_gib"] = host_gib
    return Cluster.from_dict({"nodes": [node]})


def test_host_bytes_per_rank_and_round_trip() -> None:
    graph = _graph()
    plan = solve(graph, _cluster(64), Workload(global_batch=8))
    assert staging_bytes(graph) == 2 * 4 * 256 * 1024
    assert all(r.predicted_host_bytes == staging_bytes(graph) for r in plan.ranks)  # GPU ranks: staging only
    assert Plan.from_json(plan.to_json()).ranks == plan.ranks
    assert "host GiB" in plan.table()
    assert _cluster(64).to_dict()["cluster"]["nodes"][0]["host_memory_gib"] == 64


def test_cpu_ranks_hold_their_working_set_on_the_host() -> None:
    plan = solve(_graph(), Cluster.emulated([1.0, 0.5]), Workload(global_batch=8))
    for r in plan.ranks:
        assert r.predicted_host_bytes >= r.predicted_memory_bytes > 0


def test_a_node_without_enough_host_memory_is_refused() -> None:
    with pytest.raises(InfeasibleError, match=r"node 0 has 0.0 GiB of host memory.*2 ranks need"):
        solve(_graph(), _cluster(1e-5), Workload(global_batch=8))
    solve(_graph(), _cluster(None), Workload(global_batch=8))  # not given: not checked
