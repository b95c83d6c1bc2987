"""What each rank holds, as the inputs of the one peak formula
(:func:`fxpar.profiling.memory.step_peak_bytes`), for data and tensor parallelism (pipelines:
:func:`fxpar.sim.pipeline_cost.stage_memory`; expert parallelism: :func:`fxpar.sim.expert_sim.evaluate`).

Data parallelism: the whole model, ``X = G`` on more than one rank (the flattened buckets).

Tensor parallelism (uneven, :mod:`fxpar.codegen.tensor.module`): position ``t`` of a group owns
the fraction ``κ_t = k_t / Σ k`` of every block's attention (key/value head groups) and
``μ_t = m_t / Σ m`` of every MLP's columns and of the vocabulary (embedding, LM head and the
vocab-parallel loss); norms, residuals and blocks codegen does not split stay whole.  Per
graph node ``n`` its share is ``φ_n(t)``: ``κ_t`` inside a block's attention, ``μ_t`` in the rest
of what tensor parallelism divides (``fxpar.sim.segments._tensor_parallel``) and in the loss
after a vocab-parallel head (nodes after the blocks whose tensors have the vocabulary as last
dimension), else 1.  What a node *saves* has share ``ψ_n(t)``: ``φ_n(t)``, except the first
product of each block part (attention, MLP), which saves the part's input, whole on every rank
(column-parallel: the input is replicated), ``ψ = 1``, and the vocab-parallel loss, which keeps
two logits slices where the single-device loss keeps one (:data:`VOCAB_LOSS_SAVES`).  With
``s_n``, ``o_n`` the node's saved and output bytes per sample, ``n_p`` a parameter's elements,
``ℓ`` the head's output per sample (held by the step loop through the backward):

    W, G, O = (w, g, o) · Σ_p n_p φ_p(t)        a_t = Σ_n s_n ψ_n(t) + ℓ·μ_t
    t_t     = max( 2·max_{n in blocks} o_n φ_n(t),  VOCAB_LOSS_WORKSPACE·ℓ·μ_t )
    X       = G when the group has data-parallel replicas, else 0

(no vocab-parallel head: ``ℓ`` and the loss stay whole and ``t_t = 2·max_n o_n φ_n(t)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxpar.plan import Plan
from fxpar.profiling import CostModel, memory
from fxpar.sim.segments import SegmentTable, _tensor_parallel, kept_whole, on_vocab_slice, split_parameter, vocab_size
from fxpar.tracing.graph import ModelGraph, OpClass

#: tensors of the logits slice's size fxpar's vocab-parallel loss (:mod:`fxpar.codegen.tensor.vocab`)
#: keeps for backward: the shifted logits ``z`` (``gather``'s input) and ``exp(z)``; the
#: single-device loss keeps one, ``log_softmax``'s output (what the traced graph records)
VOCAB_LOSS_SAVES = 2.0
#: slices of the logits that backward of that loss holds beyond what is saved: ``exp``'s
#: gradient and ``gather``'s (a scatter into zeros) are alive together while ``exp``'s saved
#: output is already freed (2 − 1); the single-device loss holds 2 (``nll_loss``'s gradient
#: and ``log_softmax``'s, with its saved output still alive): the CostModel's workspace
VOCAB_LOSS_WORKSPACE = 1.0


def dp_held_bytes(cost: CostModel, world: int) -> dict[str, float]:
    """A data-parallel replica's weights, gradients, optimizer state and, on more than one rank,
    the flattened gradient buckets alive until the all-reduce ends (one gradient's worth)."""
    w, g, o = memory.state_bytes_per_param(cost.optimizer, cost.dtype)
    n = cost.param_count
    return {"weights": w * n, "grads": g * n, "optimizer_state": o * n, "exchange": g * n if world > 1 else 0.0}


def _attention(module_path: str, block: str) -> bool:
    inner = module_path[len(block) + 1:] if module_path.startswith(block + ".") else ""
    return "attn" in inner.split(".")[0].lower() or "attention" in inner.split(".")[0].lower()


def node_shares(graph: ModelGraph, kv: float, mlp: float, *, saved: bool = False) -> np.ndarray:
    """``φ_n``: the share of each node's tensors one tensor-parallel rank holds (module docstring).
    ``saved``: the share of what the node *saves* — the first product of a block part saves the
    part's input, which every rank holds whole (column-parallel: the input is replicated), and
    the vocab-parallel loss saves :data:`VOCAB_LOSS_SAVES` slices of the logits."""
    vocab = vocab_size(graph)
    whole = kept_whole(graph)
    out = np.ones(len(graph.nodes))
    part_seen: set[tuple[int, bool]] = set()
    for i, n in enumerate(graph.nodes):
        if _tensor_parallel(n, graph, whole):
            blk = graph.layers[n.layer].path if n.layer is not None else ""
            attn = n.layer is not None and _attention(n.module_path, blk)
            out[i] = kv if attn else mlp
            part = (-1 if n.layer is None else n.layer, attn)
            if saved and n.op_class is OpClass.MATMUL and n.saved_bytes and part not in part_seen:
                out[i] = 1.0  # the column-parallel product keeps its (replicated) input
            if n.op_class is OpClass.MATMUL and n.saved_bytes:
                part_seen.add(part)
        elif on_vocab_slice(n, graph, vocab):
            out[i] = mlp * (VOCAB_LOSS_SAVES if saved else 1.0)  # the loss works on its logits slice
    return out


def param_shares(graph: ModelGraph, kv: float, mlp: float) -> float:
    """``Σ_p n_p φ_p``: the parameters one tensor-parallel rank holds."""
    total = 0.0
    whole = kept_whole(graph)
    for p in graph.params:
        if not split_parameter(p, graph, whole):
            total += p.numel
        elif p.layer is None:
            total += p.numel * mlp
        else:
            total += p.numel * (kv if _attention(p.module_path, graph.layers[p.layer].path) else mlp)
    return total


def tensor_parallel_peaks(plan: Plan, cost: CostModel, sizes: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each rank's peak of a ``tensor_parallel`` plan and its ``W + O`` (weights and optimizer
    state); ``sizes[r]``: rank r's micro-batches."""
    graph, st = cost.graph, plan.stages[0]
    width = max(plan.world_size // max(len(st.data_split), 1), 1)
    kv_split = st.tensor.split if st.tensor is not None else (1,) * plan.world_size
    mlp_split = st.tensor.column_split if st.tensor is not None else kv_split
    w, g, o = memory.state_bytes_per_param(cost.optimizer, cost.dtype)
    b = float(graph.batch_size)
    saved = np.array([n.saved_bytes for n in graph.nodes], dtype=float) / b
    outs = np.array([0.0 if n.op_class is OpClass.VIEW or not n.requires_grad else
                     sum(float(np.prod(s)) for s in n.out_shapes) * _itemsize(n.dtype) for n in graph.nodes]) / b
    held, vocab = memory.held_output_bytes_per_sample(graph), bool(graph.vocab_parallel_modules)
    last = max((i for i, n in enumerate(graph.nodes) if n.layer is not None), default=-1)
    tail = np.arange(len(graph.nodes)) > last   # the head and the loss
    peaks, states = [], []
    for rp in plan.ranks:
        first = rp.rank // width * width
        kv = kv_split[rp.rank] / max(sum(kv_split[first:first + width]), 1)
        mlp = mlp_split[rp.rank] / max(sum(mlp_split[first:first + width]), 1)
        phi, keep = node_shares(graph, kv, mlp), node_shares(graph, kv, mlp, saved=True)
        n = param_shares(graph, kv, mlp)
        states.append(int(w * n + o * n))
        work = 2.0 * float((outs * phi).max(initial=0.0))
        if vocab:  # the vocab-parallel loss's backward holds VOCAB_LOSS_WORKSPACE logits slices
            work = max(2.0 * float((outs * phi)[~tail].max(initial=0.0)), VOCAB_LOSS_WORKSPACE * held * mlp)
        peaks.append(memory.step_peak_bytes(
            weights=w * n, grads=g * n, optimizer_state=o * n, sizes=sizes[rp.rank],
            activation_per_sample=float(saved @ keep),
            workspace_per_sample=work,
            exchange=g * n if len(st.data_split) > 1 else 0.0))
    return peaks, states


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}.get(dtype, 4)


def stage_state_bytes(table: SegmentTable, st: Any, *, optimizer: str, dtype: str, pipelines: int,
                      zero: bool) -> float:
    """``W + O`` of one device of stage ``st`` (:func:`stage_peak_bytes`): its weights and
    optimizer state, ``w·n + o·n / P^z``."""
    w, _, o = memory.state_bytes_per_param(optimizer, dtype)
    n = float(table.local_params(st.width)[st.start:st.end].sum())
    return w * n + o * n / (pipelines if zero else 1)


def stage_peak_bytes(table: SegmentTable, st: Any, *, optimizer: str, dtype: str, in_flight: int, b: int,
                     microbatches: int, pipelines: int, zero: bool, act_share: float, first: bool,
                     last: bool, receive_in_flight: bool = False) -> int:
    """Peak of one device of a pipeline stage ``st`` (segments ``[i, e)`` of ``table``, width
    ``u``, ``act_share`` of each activation per device), the one formula with:

        n = Σ_i n_i(u);  W, G = (w, g)·n;  O = o·n / P^z;  X = g·n·[P > 1]
        a = Σ_i α_i·share + β_{e−1}·[not last]       (the stage output the schedule keeps for
                                                     its backward, as torch pipelining does)
          = Σ_i β_i                                  under activation checkpointing
        t = 2·max_i out_i·share (+ max_i α_i·share: the block recomputed, checkpointing)
        H = m·(x_{i−1}(b)·[not first] + y_{e−1}(b)·[not last])   per-micro-batch receive buffers
                                                     (every tensor cut i − 1 sends in, the
                                                     gradients cut e − 1 sends back:
                                                     ``SegmentTable.hop_messages``), with
                                                     m = min(microbatches, r) where the framework
                                                     receives into fresh tensors per transfer
                                                     (``receive_in_flight``: Megatron-LM's
                                                     p2p_communication), else every micro-batch's
                                                     (torch.distributed.pipelining allocates them
                                                     up front)
    with ``r = in_flight`` micro-batches of ``b`` samples alive at a backward's start; ``st``: a
    :class:`fxpar.sim.pipeline_cost.StageSlice` (``start``, ``end``, ``width``, ``checkpointing``)."""
    i, e = st.start, st.end
    _, g, _ = memory.state_bytes_per_param(optimizer, dtype)
    n = float(table.local_params(st.width)[i:e].sum())
    held = stage_state_bytes(table, st, optimizer=optimizer, dtype=dtype, pipelines=pipelines, zero=zero)
    out = table.out_bytes if table.out_bytes is not None else table.boundary_bytes
    work = 2.0 * float(out[i:e].max(initial=0.0)) * act_share
    send = 0.0 if last else float(table.boundary_bytes[e - 1])
    if st.checkpointing:
        act = float(table.boundary_bytes[i:e].sum())
        work += float((table.act_bytes[i:e] * act_share).max(initial=0.0))
    else:
        act = float((table.act_bytes[i:e] * act_share).sum()) + send
    recv = (0.0 if first else sum(table.hop_messages(i - 1, b)[0])) + (0.0 if last else sum(table.hop_messages(e - 1, b)[1]))
    return memory.step_peak_bytes(weights=held, grads=g * n, optimizer_state=0.0,
                                  sizes=[b] * max(microbatches, 1), in_flight=in_flight, activation_per_sample=act,
                                  workspace_per_sample=work, exchange=g * n if pipelines > 1 else 0.0,
                                  buffers=(min(max(microbatches, 1), max(in_flight, 1)) if receive_in_flight
                                           else max(microbatches, 1)) * recv)
