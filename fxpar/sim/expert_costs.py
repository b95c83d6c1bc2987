"""The data of :class:`~fxpar.sim.expert_sim.EPProblem` from a CostModel (profiling prices,
the simulator and :mod:`fxpar.solvers.expert_plan` read them).

A MoE layer's experts are found by their parameters: a module holding exactly the fused
``gate_up_proj`` (E, 2i, h) and ``down_proj`` (E, h, i) tensors, the layout
:mod:`fxpar.forms.expert.apply_module` shards (Mixtral, Qwen3-MoE).  The *expert part* of the graph
is every node inside such a module except the dispatch ops (MOE_ROUTING: sort, index, ...) and
views: its work follows the tokens routed to the experts a rank owns; everything else (attention,
router, embeddings, head, dispatch) is the replicated part and follows the rank's own samples.
The routed rows (tokens × top-k) are read from the input of each layer's first expert product.
"""

from __future__ import annotations

import numpy as np

from fxpar.profiling import memory
from fxpar.sim.expert_sim import PASSES, EPGroup, EPProblem
from fxpar.tracing.graph import OpClass

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # as fxpar.forms.expert.apply_module (no torch here)


def _moe_layout(graph):
    """(E, expert-part node mask, expert parameters in all layers, D, MoE layers); None for a
    dense model; a reason (text) when the MoE layout is not the fused one codegen runs."""
    if not any(n.op_class is OpClass.MOE_EXPERTS for n in graph.nodes):
        return None
    by_module: dict[str, dict] = {}
    for prm in graph.params:
        by_module.setdefault(prm.module_path, {})[prm.fqn.rsplit(".", 1)[-1]] = prm
    paths = sorted(m for m, ps in by_module.items() if set(ps) & set(EXPERT_PARAMS))
    sizes = {q.shape[0] for m in paths for q in by_module[m].values() if q.shape}
    if not paths or len(sizes) != 1 or any(
            set(by_module[m]) != set(EXPERT_PARAMS) or any(len(q.shape) != 3 for q in by_module[m].values())
            for m in paths):
        return (f"the experts are not the fused {' + '.join(EXPERT_PARAMS)} (E, ., .) layout expert "
                "parallelism runs (Mixtral, Qwen3-MoE)")
    pset, inside = set(paths), {}

    def owner(path: str) -> str | None:
        if path not in inside:
            head = path
            while head and head not in pset:
                head = head.rpartition(".")[0]
            inside[path] = head or None
        return inside[path]

    mask = np.array([n.op_class not in (OpClass.MOE_ROUTING, OpClass.VIEW) and owner(n.module_path) is not None
                     for n in graph.nodes], dtype=bool)
    rows: dict[str, float] = {}
    for n in graph.nodes:  # routed rows x hidden x itemsize entering each layer's first product
        m = owner(n.module_path)
        h = by_module[m]["gate_up_proj"].shape[-1] if m else 0
        if m and m not in rows and n.op_class is OpClass.MOE_EXPERTS:
            shape = next((s for s in n.in_shapes if len(s) == 2 and s[-1] == h), None)
            if shape is not None:
                rows[m] = shape[0] * h * {"float16": 2, "bfloat16": 2, "float64": 8}.get(n.dtype, 4)
    if len(rows) != len(paths):
        return "the traced graph does not show how many tokens reach the experts"
    expert_params = sum(q.numel for m in paths for q in by_module[m].values())
    return sizes.pop(), mask, expert_params, PASSES * sum(rows.values()) / graph.batch_size, len(paths)


def expert_node_mask(graph) -> np.ndarray | None:
    """Which graph nodes are the expert part expert parallelism divides by experts (None for a
    dense model or a MoE layout it cannot run)."""
    layout = _moe_layout(graph)
    return layout[1] if isinstance(layout, tuple) else None


def build_problem(cost, global_batch: int, max_microbatches: int | None = None) -> EPProblem | str | None:
    """The search's data from a CostModel (symbols: :mod:`fxpar.sim.expert_sim`); None for a
    dense model, a reason (text) when this MoE cannot run expert-parallel."""
    graph, cluster = cost.graph, cost.cluster
    layout = _moe_layout(graph)
    if not isinstance(layout, tuple):
        return layout
    E, mask, expert_total, D, layers = layout
    N, P, b = cluster.world_size, graph.param_count - expert_total, float(graph.batch_size)
    groups = []
    for g in cluster.groups():
        nc = cost.node_costs(g)
        c, a = nc.fwd_c + nc.bwd_c, nc.fwd_a + nc.bwd_a
        groups.append(EPGroup(key=g.key, ranks=tuple(g.ranks), sample_s=float(c[~mask].sum()),
                              fixed_s=float(a[~mask].sum()), expert_sample_s=float(c[mask].sum()),
                              expert_fixed_s=float(a[mask].sum()), memory_bytes=int(g.memory_bytes),
                              optimizer_s_per_param=cost.optimizer_s(g) / max(graph.param_count, 1)))
    nodes: dict[int, list[int]] = {}
    for d in cluster.devices:
        nodes.setdefault(d.node, []).append(d.rank)
    order, network = sorted(nodes), cost.network()
    a2a_alpha, _ = network.alltoall_parts()
    intra_s_per_byte, nic_s_per_byte = network.expert_links([nodes[j] for j in order])
    saved_x = sum(n.saved_bytes for n, m in zip(graph.nodes, mask) if m) / b
    state = lambda n: memory.model_state_bytes(n, cost.optimizer, cost.dtype)
    grads = memory.gradient_bytes(P, cost.optimizer, cost.dtype)
    wire_grads = P * cost.policy().reduce_bytes   # as the runtime sums them (reduce dtype)
    return EPProblem(
        groups=tuple(groups), nodes=tuple(tuple(nodes[j]) for j in order),
        intra_s_per_byte=intra_s_per_byte, nic_s_per_byte=nic_s_per_byte,
        global_batch=global_batch, num_experts=E, routed_bytes_per_sample=D,
        a2a_fixed_s=layers * (PASSES * a2a_alpha + network.allgather_s(8.0 * N * E)
                              + (PASSES + 1) * cost.runtime_overhead("expert_call_s")),
        state_bytes=state(P) + (grads if N > 1 else 0), expert_state_bytes=state(expert_total // E),
        activation_bytes_per_sample=(cost.activation_bytes_per_sample() - saved_x
                                     + cost.transient_bytes_per_sample()),
        expert_activation_bytes_per_sample=saved_x, replicated_params=P, expert_params=expert_total // E,
        allreduce_s=cost.allreduce_s(wire_grads) if N > 1 else 0.0, max_microbatches=max_microbatches,
        grad_bytes_per_param=memory.state_bytes_per_param(cost.optimizer, cost.dtype)[1],
        exchange_bytes=grads if N > 1 else 0.0, workspace_bytes_per_sample=cost.transient_bytes_per_sample(),
        step_overhead_s=cost.step_overhead_s())
