"""The traced model as plain data: :class:`ModelGraph` and its nodes.

A ModelGraph is what every later stage reads.  The numbers (FLOPs, bytes, parameter sizes,
activation bytes) are plain Python values so that the cost model and the solvers never touch
torch objects; the :class:`torch.export.ExportedProgram` rides along (``exported``, excluded
from equality and repr) for codegen only.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class OpClass(str, enum.Enum):
    """What kind of work a node does; the roofline picks its efficiency by class."""

    MATMUL = "matmul"          # linear / mm / bmm / conv: compute-bound on large shapes
    ATTENTION = "attention"    # scaled dot-product attention
    EMBEDDING = "embedding"    # table lookup: memory-bound, no FLOPs
    NORM = "norm"              # reductions used by layer/RMS norms and softmax
    ELEMENTWISE = "elementwise"  # pointwise math: memory-bound
    LOSS = "loss"              # cross entropy and friends
    MOE_ROUTING = "moe_routing"  # router logits, top-k, token sort/dispatch/combine of MoE layers
    MOE_EXPERTS = "moe_experts"  # the experts' (grouped) matrix products
    COLLECTIVE = "collective"  # communication already present in the traced graph
    VIEW = "view"              # metadata only: no bytes moved, no FLOPs
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class OpNode:
    """One operation of the exported graph, with its cost inputs."""

    name: str
    target: str                       # e.g. "aten.linear.default"
    op_class: OpClass
    module_path: str                  # innermost nn.Module path, "" for the root
    layer: int | None                 # index of the repeated block it belongs to, None outside blocks
    out_shapes: tuple[tuple[int, ...], ...]
    dtype: str                        # dtype of the first tensor output ("" if none)
    fwd_flops: int
    bwd_flops: int
    bytes_read: int
    bytes_written: int
    saved_bytes: int                  # activation bytes this node keeps alive for backward
    param_fqns: tuple[str, ...]       # parameters the node reads directly
    requires_grad: bool
    in_shapes: tuple[tuple[int, ...], ...] = ()   # tensor inputs (lists flattened), in order
    in_dtypes: tuple[str, ...] = ()
    args_repr: str = ""               # the non-tensor arguments, for profile keys
    #: under torch.autocast (fp32 master weights, bf16/fp16 forward: :mod:`fxpar.tracing.saved`):
    #: the bytes this node keeps for backward (-1: not computed, as traced) and its output's dtype
    #: ("": as traced; the low type is written "bfloat16", fp16 has its size)
    amp_saved_bytes: int = -1
    amp_dtype: str = ""


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One (deduplicated) parameter: its canonical FQN and the names it is tied to."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int
    module_path: str
    layer: int | None
    aliases: tuple[str, ...] = ()     # other FQNs of the same tensor (tied embeddings)


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """A repeated block (``model.layers.3``): the unit stage cuts count in."""

    index: int
    path: str
    module_type: str
    param_count: int
    fwd_flops: int
    bwd_flops: int
    #: fxpar's tensor-parallel codegen can split this block's attention / MLP / experts
    tensor_parallel: bool = True


@dataclass(frozen=True, slots=True)
class CutTensor:
    """One value a pipeline cut sends to the next stage (:mod:`fxpar.tracing.cuts`)."""

    name: str              # the node that makes it (a model input's placeholder name for an input)
    per_sample: float      # elements per sample (0 for a value that does not grow with the batch)
    fixed: float           # elements per micro-batch that do not grow with it
    dtype: str             # as sent: floating as computed, integers and booleans as float32
    grad: bool             # its gradient comes back in the backward

    def nbytes(self, samples: float) -> float:
        """Bytes sent for a micro-batch of ``samples``."""
        return (self.per_sample * samples + self.fixed) * float_bytes(self.dtype)


_FLOAT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def float_bytes(dtype: str) -> int:
    """Bytes per element of a floating dtype named as the graph names it (4 for any other)."""
    return _FLOAT_BYTES.get(dtype, 4)


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    """Per-sample totals of a ModelGraph: the only model facts the DP solver needs."""

    fwd_flops_per_sample: float
    bwd_flops_per_sample: float
    param_count: int
    param_bytes: int
    activation_bytes_per_sample: float
    memory_bound_bytes_per_sample: float


@dataclass(frozen=True)
class ModelGraph:
    """A traced model: nodes with costs, deduplicated parameters, repeated layers.

    ``batch_size`` is the batch the graph was traced with; per-sample figures divide by it.
    """

    model_name: str
    batch_size: int
    seq_len: int | None
    nodes: tuple[OpNode, ...]
    params: tuple[ParamInfo, ...]
    layers: tuple[LayerInfo, ...]
    input_names: tuple[str, ...]
    trace_time_s: float
    exported: Any = field(default=None, compare=False, repr=False)
    #: batch-normalised key per node (profiling.keys), empty unless traced at two batch sizes
    op_keys: tuple[str, ...] = ()
    #: module paths of the input embedding and LM head when tensor parallelism splits them by
    #: vocabulary (codegen/tensor/vocab.py); empty when they stay replicated
    vocab_parallel_modules: tuple[str, ...] = ()
    #: the HF attention implementation the model was traced with (``"sdpa"``, ``"eager"``...;
    #: None for a model without a HF config): eager attention keeps its seq x seq scores
    attn_implementation: str | None = None
    #: what tensor parallelism can split, read from the graph (:mod:`fxpar.tracing.tensor_parallel.analysis`);
    #: ``LayerInfo.tensor_parallel`` is its ``splittable()`` — one source for planner and codegen
    tp_analysis: Any = field(default=None, compare=False, repr=False)
    #: trainable parameters the exported graph cannot differentiate (a custom autograd Function
    #: computing under no_grad, :mod:`fxpar.tracing.grad_paths`): no pipeline may run this graph
    lost_gradients: tuple[str, ...] = ()
    #: non-empty when the whole model did not export and the graph was recorded by running it
    #: (:mod:`fxpar.tracing.recorded`; the export's error): no exported program, so no tensor- or
    #: expert-parallel plan (pipelines run eager stages, :mod:`fxpar.forms.pipeline.apply_eager`)
    recorded: str = ""
    #: per pipeline cut ``k`` (after segment ``k``: ``pre``, then each block), the values it sends
    #: (:mod:`fxpar.tracing.cuts`); empty when unknown (a recorded graph): the pricing then takes
    #: the hidden state alone, both ways
    cuts: tuple[tuple[CutTensor, ...], ...] = ()

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes)

    @property
    def activation_bytes(self) -> int:
        return sum(n.saved_bytes for n in self.nodes)

    def under_autocast(self) -> "ModelGraph":
        """This graph as a mixed-precision step runs it (fp32 master weights, forward under
        ``torch.autocast``): each node's ``saved_bytes`` and ``dtype`` replaced by its
        ``amp_saved_bytes`` and ``amp_dtype`` where the trace computed them
        (:mod:`fxpar.tracing.saved`), everything else (FLOPs, bytes moved, shapes) as traced.
        Idempotent."""
        nodes = tuple(n if n.amp_saved_bytes < 0 and not n.amp_dtype else
                      dataclasses.replace(n, saved_bytes=n.amp_saved_bytes if n.amp_saved_bytes >= 0 else n.saved_bytes,
                                          dtype=n.amp_dtype or n.dtype) for n in self.nodes)
        amp = {n.name: n.amp_dtype for n in self.nodes if n.amp_dtype}
        cuts = tuple(tuple(dataclasses.replace(t, dtype=amp[t.name]) if amp.get(t.name) in _FLOAT_BYTES
                           else t for t in cut) for cut in self.cuts)
        return dataclasses.replace(self, nodes=nodes, cuts=cuts)

    def summary(self) -> WorkloadSummary:
        """Per-sample totals (FLOPs and activation bytes scale linearly with the batch)."""
        b = float(self.batch_size)
        memory_bound = sum(
            n.bytes_read + n.bytes_written
            for n in self.nodes
            if n.op_class not in (OpClass.MATMUL, OpClass.ATTENTION, OpClass.MOE_EXPERTS, OpClass.VIEW)
        )
        return WorkloadSummary(
            fwd_flops_per_sample=self.fwd_flops / b,
            bwd_flops_per_sample=self.bwd_flops / b,
            param_count=self.param_count,
            param_bytes=self.param_bytes,
            activation_bytes_per_sample=self.activation_bytes / b,
            memory_bound_bytes_per_sample=memory_bound / b,
        )

    def __str__(self) -> str:
        s = self.summary()
        return (
            f"ModelGraph({self.model_name}: {len(self.nodes)} ops, {len(self.layers)} blocks, "
            f"{s.param_count / 1e6:.2f}M params, traced at batch {self.batch_size}"
            f"{'' if self.seq_len is None else f' x seq {self.seq_len}'}, "
            f"{(s.fwd_flops_per_sample + s.bwd_flops_per_sample) / 1e9:.2f} GFLOP/sample fwd+bwd)"
        )
