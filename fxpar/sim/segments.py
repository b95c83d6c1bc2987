"""The model as a chain of segments, in plain numbers: ``pre`` (embeddings, everything before
the first repeated block), one segment per block, ``post`` (final norm, head, loss).

Stage cuts are made between segments.  Per segment and device kind the table holds the
affine compute cost (``a`` per micro-batch, ``c`` per sample, forward + backward), and per
segment the parameters, saved activations per sample, the hidden-state bytes per sample that
leave it, every tensor a pipeline cut after it sends (the hidden state and what later segments
read beside it: the mask, rotary tables, labels; ``hop_messages``), and the fraction of its time that tensor parallelism
divides (everything inside attention / MLP / experts submodules, embeddings, products).

Tensor parallelism's all-reduces per sample (``tp_messages``, what codegen's ``tp_copy`` /
``tp_reduce`` send; ``β_j`` the hidden state a segment sends on, in fp32 as the residual stream
stays under autocast; ``r`` = 1/2 in bf16 / fp16, where autocast makes the row-parallel outputs
half precision, else 1):

    block       forward  β_j·r, β_j·r   (attention and MLP outputs)    backward  β_j, β_j (their inputs)
    pre         forward  β_0            (a vocabulary-parallel embedding's partial lookups)
    post        forward  3 × 4·seq      (a vocabulary-parallel loss: max, sum of exponentials,
                                         the label's logit per token)   backward  β_L (the head's input)

(``pre`` / ``post`` only where the embedding / head is split by vocabulary.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fxpar.profiling import CostModel
from fxpar.tracing.graph import CutTensor, ModelGraph, OpClass, float_bytes

_SHARDED = (OpClass.MATMUL, OpClass.ATTENTION, OpClass.MOE_EXPERTS)


@dataclass(frozen=True)
class SegmentTable:
    names: tuple[str, ...]
    modules: tuple[tuple[str, ...], ...]     # module FQN prefixes each segment owns
    params: np.ndarray                       # parameters per segment
    act_bytes: np.ndarray                    # saved activation bytes per sample
    boundary_bytes: np.ndarray               # bytes per sample sent to the next segment
    sharded_fraction: np.ndarray             # of the segment's time, what TP divides
    cost_a: Mapping[str, np.ndarray]         # kind -> per-micro-batch seconds per segment
    cost_c: Mapping[str, np.ndarray]         # kind -> per-sample seconds per segment
    fwd_a: Mapping[str, np.ndarray]          # forward part of cost_a (recomputed under checkpointing)
    fwd_c: Mapping[str, np.ndarray]
    #: parameters per segment that tensor parallelism splits (None: all of them)
    sharded_params: np.ndarray | None = None
    #: per segment, the largest output of a node that needs a gradient, bytes per sample (the
    #: backward workspace is twice it: that output's gradient and its input's; None: unknown)
    out_bytes: np.ndarray | None = None
    #: per segment, (forward, backward) bytes per sample of each tensor-parallel all-reduce
    #: (module docstring; None: two each way of ``boundary_bytes`` in every segment but ``pre``)
    tp_messages: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] | None = None
    #: parameter tensors per segment (ZeRO-1 broadcasts each one: one call apiece; None: one)
    param_tensors: np.ndarray | None = None
    #: per segment, the values it sends to the next when a pipeline cuts after it
    #: (:attr:`fxpar.tracing.graph.ModelGraph.cuts`; the last sends none); None: unknown, the
    #: hidden state (``boundary_bytes``) alone, both ways
    sends: tuple[tuple[CutTensor, ...], ...] | None = None
    #: kind -> per-micro-batch seconds per segment that tensor parallelism does not divide: the
    #: per-op launches of its nodes (``NodeCosts.fwd_o + bwd_o``), and their forward part; None:
    #: none (every second of ``cost_a`` divides as ``cost_c`` does)
    launch_a: Mapping[str, np.ndarray] | None = None
    launch_fwd_a: Mapping[str, np.ndarray] | None = None

    def stage_seconds(self, kind: str, b: float, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment, a rank's (forward + backward, forward) seconds of a micro-batch of ``b``
        samples where tensor parallelism leaves it ``scale`` (``σ_i = φ_i·share + 1 − φ_i``,
        :mod:`fxpar.sim.pipeline_cost`) of each segment's work; its ops' launches (``launch_a``)
        stay whole: a split product is still one launch on every rank of the group.

            t_i = (a_i − l_i + c_i·b)·σ_i + l_i,   forward alike with its own parts"""
        launch = self.launch_a[kind] if self.launch_a is not None else 0.0
        fwd_launch = self.launch_fwd_a[kind] if self.launch_fwd_a is not None else 0.0
        total = (self.cost_a[kind] - launch + self.cost_c[kind] * b) * scale + launch
        fwd = (self.fwd_a[kind] - fwd_launch + self.fwd_c[kind] * b) * scale + fwd_launch
        return total, fwd

    def hop_messages(self, j: int, b: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The bytes of each tensor a cut after segment ``j`` sends for a micro-batch of ``b``
        samples: (forward, the gradients coming back)."""
        if self.sends is None:
            x = float(self.boundary_bytes[j]) * b
            return (x,), (x,)
        cut = self.sends[j] if j < len(self.sends) else ()
        return tuple(t.nbytes(b) for t in cut), tuple(t.nbytes(b) for t in cut if t.grad)

    def tensors(self, start: int, end: int) -> int:
        """Parameter tensors of segments ``[start, end)`` (at least one)."""
        return 1 if self.param_tensors is None else max(int(self.param_tensors[start:end].sum()), 1)

    def tp_message_bytes(self) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
        """``tp_messages``, or its default (see the field)."""
        if self.tp_messages is not None:
            return self.tp_messages
        return (((), ()),) + tuple(((float(b),) * 2, (float(b),) * 2) for b in self.boundary_bytes[1:])

    @property
    def size(self) -> int:
        return len(self.names)

    def local_params(self, width: int) -> np.ndarray:
        """Parameters per segment that one rank of a width-``width`` tensor-parallel stage holds:
        its share of the split ones, all of the replicated ones."""
        split = self.params if self.sharded_params is None else self.sharded_params
        return split / width + (self.params - split)


@dataclass(frozen=True)
class KeptWhole:
    """What tensor parallelism keeps whole on every rank inside the blocks it splits
    (``Attention.shared_params``, gradients summed over the group): those parameters, and the
    modules that compute on the whole replicated input — the ones holding only such parameters,
    less per-head norms (weights of one head's size, which run on the rank's own heads):
    latent attention's down projections and their norms, DeepSeek-V4's key/value projection,
    compressor and indexer."""

    params: frozenset[str] = frozenset()
    modules: frozenset[str] = frozenset()


def kept_whole(graph: ModelGraph) -> KeptWhole:
    """:class:`KeptWhole` of ``graph``'s tensor-parallel analysis (nothing without one)."""
    tp = graph.tp_analysis
    if tp is None:
        return KeptWhole()
    atts = [a for b in tp.blocks if b.splittable for a in b.attention]
    shared = frozenset(f for a in atts for f in a.shared_params)
    head = max((a.head_dim for a in atts), default=0)
    by_module: dict[str, list] = {}
    for p in graph.params:
        by_module.setdefault(p.module_path, []).append(p)
    modules = {m for m, ps in by_module.items()
               if all(p.fqn in shared or shared.intersection(p.aliases) for p in ps)
               and not all(len(p.shape) == 1 and p.numel <= head for p in ps)}
    return KeptWhole(params=shared, modules=frozenset(modules))


def split_parameter(p, graph: ModelGraph, whole: KeptWhole = KeptWhole()) -> bool:
    """Whether tensor parallelism splits parameter ``p`` (a ``ParamInfo``): inside a splittable
    block's attention / MLP / experts and not kept whole (:func:`kept_whole`), or in a
    vocab-parallel embedding / head."""
    if p.layer is None:
        return p.module_path in graph.vocab_parallel_modules
    layer = graph.layers[p.layer]
    return layer.tensor_parallel and _inside_block_part(p.module_path, layer.path) and p.fqn not in whole.params


def vocab_size(graph: ModelGraph) -> int | None:
    """The rows of the vocab-parallel embedding / head (None: no vocab-parallel head, or rows
    that disagree)."""
    sizes = {p.shape[0] for p in graph.params if p.module_path in graph.vocab_parallel_modules and p.shape}
    return sizes.pop() if len(sizes) == 1 else None


def _vocab_split_product(node, graph: ModelGraph) -> bool:
    """The vocab-parallel embedding's lookup or head's product itself."""
    return node.module_path in graph.vocab_parallel_modules and node.op_class in (OpClass.MATMUL, OpClass.EMBEDDING)


def on_vocab_slice(node, graph: ModelGraph, vocab: int | None) -> bool:
    """A node of the vocab-parallel loss: outside the blocks, not a view, not the head's product,
    with a tensor whose last dimension is the vocabulary (``vocab``, :func:`vocab_size`) —
    each rank computes it on its slice of the logits (:mod:`fxpar.codegen.tensor.vocab`)."""
    return (bool(vocab) and node.layer is None and node.op_class is not OpClass.VIEW
            and not _vocab_split_product(node, graph)
            and any(s and s[-1] == vocab for s in node.out_shapes + node.in_shapes))


def _tensor_parallel(node, graph: ModelGraph, whole: KeptWhole = KeptWhole(), vocab: int | None = None) -> bool:
    """Tensor parallelism as fxpar's codegen runs it divides everything inside a block's
    attention / MLP / experts submodules (column-parallel in, row-parallel out) but the modules
    it keeps whole on every rank (``whole``: :func:`kept_whole`); the block-level norms and
    residual adds stay replicated, and so do blocks whose attention codegen does not
    recognise; the embedding and head are split by vocabulary where codegen does that
    (``graph.vocab_parallel_modules``), else replicated, and so is the loss on the head's
    logits (``vocab``: :func:`vocab_size`; :func:`on_vocab_slice`; None: the loss not counted)."""
    if node.op_class is OpClass.VIEW or node.module_path in whole.modules:
        return False
    if node.layer is None:
        return _vocab_split_product(node, graph) or on_vocab_slice(node, graph, vocab)
    if not graph.layers[node.layer].tensor_parallel:
        return False
    if node.op_class in _SHARDED:
        return True
    return _inside_block_part(node.module_path, graph.layers[node.layer].path)


def _inside_block_part(module_path: str, block: str) -> bool:
    """A module inside a block's attention / MLP / experts (not the block's own norms)."""
    inner = module_path[len(block) + 1:] if module_path.startswith(block + ".") else ""
    return bool(inner) and "norm" not in inner.lower()


def segment_of_nodes(graph: ModelGraph) -> np.ndarray:
    """The segment of every graph node: 0 (``pre``) before the first block, ``l + 1`` inside block
    ``l``, ``L + 1`` (``post``) after the blocks."""
    seg_of = np.zeros(len(graph.nodes), dtype=int)
    seen_layer = False
    for i, node in enumerate(graph.nodes):
        if node.layer is not None:
            seg_of[i] = node.layer + 1
            seen_layer = True
        else:
            seg_of[i] = 0 if not seen_layer else len(graph.layers) + 1
    return seg_of


def build_segments(graph: ModelGraph, cost: CostModel, kinds: Mapping[str, object]) -> SegmentTable:
    """Segment table of ``graph``; ``kinds`` maps a device-kind key to a Device/DeviceGroup."""
    n_layers = len(graph.layers)
    seg_of = segment_of_nodes(graph)
    n_seg = n_layers + 2
    b = float(graph.batch_size)
    act = np.zeros(n_seg)
    boundary = np.zeros(n_seg)
    out_max = np.zeros(n_seg)
    for i, node in enumerate(graph.nodes):
        act[seg_of[i]] += node.saved_bytes / b
        if node.requires_grad and node.op_class is not OpClass.VIEW:
            out = sum(float(np.prod(sh)) for sh in node.out_shapes) * float_bytes(node.dtype) / b
            out_max[seg_of[i]] = max(out_max[seg_of[i]], out)
        if node.out_shapes and node.op_class is not OpClass.VIEW and node.dtype.startswith(("float", "bfloat")):
            boundary[seg_of[i]] = float(np.prod(node.out_shapes[0])) * float_bytes(node.dtype) / b
    if n_layers:  # what leaves the embeddings is the hidden state the first block reads
        boundary[0] = max(boundary[0], boundary[1])
    params = np.zeros(n_seg)
    tensors = np.zeros(n_seg)
    split_params = np.zeros(n_seg)
    whole = kept_whole(graph)
    pre_modules: set[str] = set()
    post_modules: set[str] = set()
    for p in graph.params:
        seg = p.layer + 1 if p.layer is not None else None
        if seg is None:
            users = [seg_of[i] for i, n in enumerate(graph.nodes) if p.fqn in n.param_fqns]
            seg = min(users) if users else 0
            (pre_modules if seg == 0 else post_modules).add(p.module_path)
        params[seg] += p.numel
        tensors[seg] += 1
        if split_parameter(p, graph, whole):
            split_params[seg] += p.numel
    costs, frac = _segment_costs(graph, cost, kinds, seg_of, n_seg, whole)
    names = ("pre",) + tuple(layer.path for layer in graph.layers) + ("post",)
    modules = ((tuple(sorted(pre_modules)),) + tuple((layer.path,) for layer in graph.layers)
               + (tuple(sorted(post_modules)),))
    return SegmentTable(names=names, modules=modules, params=params, act_bytes=act,
                        boundary_bytes=boundary, sharded_fraction=frac, cost_a=costs["cost_a"], cost_c=costs["cost_c"],
                        fwd_a=costs["fwd_a"], fwd_c=costs["fwd_c"], sharded_params=split_params, out_bytes=out_max,
                        tp_messages=_tp_messages(graph, cost.dtype, boundary, pre_modules, post_modules),
                        param_tensors=tensors, sends=graph.cuts + ((),) if len(graph.cuts) == n_seg - 1 else None,
                        launch_a=costs.get("launch_a"), launch_fwd_a=costs.get("launch_fwd_a"))


def _segment_costs(graph: ModelGraph, cost: CostModel, kinds: Mapping[str, object], seg_of: np.ndarray,
                   n_seg: int, whole: KeptWhole) -> tuple[dict[str, dict[str, np.ndarray]], np.ndarray]:
    """Per device kind, each segment's summed node costs (``cost_a`` / ``cost_c`` forward +
    backward, ``fwd_a`` / ``fwd_c`` the forward, ``launch_a`` / ``launch_fwd_a`` the per-op
    launches where the cost model counts them apart), and the fraction of each segment's
    per-sample seconds that tensor parallelism divides (``sharded_fraction``, from the first kind)."""
    vocab = vocab_size(graph)
    sharded = np.array([_tensor_parallel(n, graph, whole, vocab) for n in graph.nodes])
    out: dict[str, dict[str, np.ndarray]] = {k: {} for k in ("cost_a", "cost_c", "fwd_a", "fwd_c", "launch_a",
                                                             "launch_fwd_a")}
    frac = np.zeros(n_seg)

    def per_segment(values: np.ndarray) -> np.ndarray:
        return np.bincount(seg_of, weights=values, minlength=n_seg)

    for key, dev in kinds.items():
        nc = cost.node_costs(dev)
        c = nc.fwd_c + nc.bwd_c
        out["cost_a"][key], out["cost_c"][key] = per_segment(nc.fwd_a + nc.bwd_a), per_segment(c)
        out["fwd_a"][key], out["fwd_c"][key] = per_segment(nc.fwd_a), per_segment(nc.fwd_c)
        if nc.fwd_o is not None and nc.bwd_o is not None:
            out["launch_a"][key], out["launch_fwd_a"][key] = per_segment(nc.fwd_o + nc.bwd_o), per_segment(nc.fwd_o)
        if not frac.any():
            tot = per_segment(c)
            frac = np.divide(per_segment(np.where(sharded, c, 0.0)), tot, out=np.zeros(n_seg), where=tot > 0)
    complete = {k: v for k, v in out.items() if len(v) == len(kinds)}   # launches: every kind or none
    return complete, frac


def _tp_messages(graph: ModelGraph, dtype: str, boundary: np.ndarray, pre: set[str], post: set[str]):
    """``SegmentTable.tp_messages`` (module docstring): per segment, the forward and backward
    all-reduces' bytes per sample."""
    vocab, n = set(graph.vocab_parallel_modules), len(graph.layers)
    half = 0.5 if dtype in ("bf16", "fp16") else 1.0
    blocks = tuple(((float(boundary[j]) * half,) * 2, (float(boundary[j]),) * 2) for j in range(1, n + 1))
    first = ((float(boundary[0]),), ()) if vocab & pre else ((), ())
    last = ((4.0 * (graph.seq_len or 1),) * 3, (float(boundary[n]),)) if vocab & post else ((), ())
    return (first,) + blocks + (last,)


def tp_seconds(table: SegmentTable, network, kind: str, width: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Per segment: its tensor-parallel all-reduces' seconds forward and backward for a
    micro-batch of ``b`` samples on a width-``width`` group of ``kind`` (module docstring; each
    priced by :meth:`fxpar.profiling.network.Network.tp_allreduce_s`; zeros for ``width`` 1)."""
    messages = table.tp_message_bytes()
    sizes = np.array([float(x) * b for fwd, bwd in messages for x in fwd + bwd])
    times = list(network.tp_allreduce_s(kind, width, sizes)) if len(sizes) else []
    fwd, bwd, k = np.zeros(len(messages)), np.zeros(len(messages)), 0
    for j, (f, bw) in enumerate(messages):
        fwd[j], bwd[j] = sum(times[k:k + len(f)]), sum(times[k + len(f):k + len(f) + len(bw)])
        k += len(f) + len(bw)
    return fwd, bwd
