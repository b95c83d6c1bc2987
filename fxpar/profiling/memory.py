"""Memory model: bytes of model state per replica and of activations per sample.

Model state per parameter (ZeRO paper §3, reference section 3), ``Ψ`` parameters:

    optimizer   precision        weights  grads  optimizer state            total
    adam/adamw  fp32             4        4      8  (m, v)                  16 Ψ
    adam/adamw  fp16/bf16 mixed  2        2      12 (fp32 master, m, v)     16 Ψ
    sgd         fp32             4        4      4  (momentum)              12 Ψ
    sgd         fp16/bf16 mixed  2        2      8  (fp32 master, momentum) 12 Ψ

fxpar's mixed precision (:mod:`fxpar.runtime.precision`) keeps the parameters themselves in fp32
(the master weights), their gradients in fp32 and AdamW's ``m, v``: 4 + 4 + 8 bytes; its forward
under ``torch.autocast`` adds a bf16/fp16 copy of each weight a matmul reads (cached for the
forward, kept by autograd until the backward uses it).  The mixed rows above charge the same
16 Ψ: ``W + O`` = 2 + 12 is the fp32 weights, ``m, v`` and the autocast copies, alive when a
backward starts; ``W + O + G`` = 16 is the fp32 state after the last backward, the copies freed.
(The copies are charged for every parameter; an input embedding is never cast, so its 2 bytes
per parameter are an over-statement.)

Activations: the traced graph's saved-for-backward bytes per sample (see
:mod:`fxpar.tracing.saved`): in fp32, as traced; in fp16/bf16, as ``torch.autocast`` keeps them
(:meth:`fxpar.tracing.graph.ModelGraph.under_autocast`: matmul inputs and outputs in the low
type, a copy per matmul of an fp32 input, norms and residuals in fp32), whatever precision the
model was traced in.

Peak of a training step (:func:`step_peak_bytes`, every form; checked against the CPU
allocator's live tensor bytes by ``python -m benchmarks.memory_fidelity``).  A rank holds its
weights ``W`` and optimizer state ``O`` across steps (AdamW's ``m, v`` exist from the first
``optimizer.step()`` on; the predicted peak is the steady state's, which no earlier step
exceeds).  Gradients ``G`` are allocated by the step's first backward and live until
``zero_grad()`` (set to None between steps).  Micro-batches ``s_0 .. s_{m−1}`` each leave
``a·s_j`` bytes of saved activations (the step loop drops the model output, e.g. a causal
LM's ``B·S·V`` logits, before the backward: autograd keeps its own copy), ``r`` of them alive when one's backward starts (1 without
a pipeline).  The backward's first op needs a workspace ``t·s_j`` on top: for a causal LM the
gradient of the loss w.r.t. the ``log_softmax`` output and w.r.t. the logits, ``2·B·S·V`` fp32
elements, while the saved ``log_softmax`` output is still alive (the largest output of the
graph, twice: :meth:`fxpar.profiling.CostModel.transient_bytes_per_sample`).  The backward frees
activations as it produces gradients; the live bytes are highest at one of two moments:

    the start of backward j:  W + O + H + G·[j ≥ 1] + a·Σ_{i=j}^{min(j+r,m)−1} s_i + t·s_j
    after the last backward:  W + O + H + G + X

``H``: runtime buffers kept across steps (a pipeline stage's per-micro-batch receive buffers);
``X``: gradient-exchange copies (data parallelism's flattened buckets, one gradient's worth).
So the first micro-batch's backward has no gradients yet, every later one the accumulated
gradients; one micro-batch of ``B`` samples on one device peaks at ``W + O + (a + t)·B`` when
activations dominate, not at ``W + O + G + (a + t)·B``.  The middle of a backward (activations
partly freed, gradients partly produced) is taken as never higher than these two ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fxpar.errors import ConfigError
from fxpar.tracing.graph import ModelGraph, OpClass
from fxpar.workload import OPTIMIZERS

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}

_STATE_BYTES = {  # (optimizer family, mixed precision?) -> (weights, grads, optimizer) bytes/param
    ("adam", False): (4, 4, 8),
    ("adam", True): (2, 2, 12),
    ("sgd", False): (4, 4, 4),
    ("sgd", True): (2, 2, 8),
}


def _family(optimizer: str) -> str:
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer = {optimizer!r}: accepted values are {', '.join(OPTIMIZERS)}")
    return "adam" if optimizer in ("adam", "adamw", "fused_adamw") else "sgd"


def state_bytes_per_param(optimizer: str, dtype: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter for a training precision."""
    return _STATE_BYTES[(_family(optimizer), dtype in ("fp16", "bf16"))]


def model_state_bytes(param_count: int, optimizer: str, dtype: str) -> int:
    """Weights + gradients + optimizer state of one full replica."""
    return int(param_count) * sum(state_bytes_per_param(optimizer, dtype))


def optimizer_traffic_bytes_per_param(optimizer: str, dtype: str) -> int:
    """Bytes torch's default optimizer step reads and writes per parameter (a memory-bound
    update): its ``foreach`` implementation on a GPU, its per-tensor one on a CPU, the same ops
    either way, each a pass over fp32 tensors of 4 bytes an element (the master weights under
    autocast are fp32 too, so the precision changes nothing).

    AdamW, 80 bytes: ``p *= 1 − lr·wd`` (read p, write p: 8), ``m.lerp_(g)`` (read m, g, write m:
    12), ``v *= β₂`` (8), ``v.addcmul_(g, g)`` (read v, g, write v: 12), ``d = sqrt(v)`` (8),
    ``d /= c₂`` (8), ``d += ε`` (8), ``p.addcdiv_(m, d)`` (read p, m, d, write p: 16).  (The
    fused kernel moves 28: ``fused_adamw``, ``AdamW(fused=True)``, as Megatron's and DeepSpeed's
    fused Adam.)
    SGD with momentum, 32: ``b *= μ`` (8), ``b += g`` (12), ``p −= lr·b`` (12).

    An H200 measured 21-22 ns per parameter in the plain HF loop's AdamW step (GPT-2 124M: 2.74 ms,
    the 1.1B Llama: 23.3 ms; ``benchmarks.step_breakdown``, 2026-11-30): 80 bytes at 80 % of its
    4.8 TB/s is 21 ns, the 28 of a fused step 7."""
    del dtype   # every precision alike (docstring)
    if optimizer == "fused_adamw":
        return 28
    return 80 if _family(optimizer) == "adam" else 32


def gradient_bytes(param_count: int, optimizer: str, dtype: str) -> int:
    """Bytes of the gradients that data parallelism all-reduces each step."""
    return int(param_count) * state_bytes_per_param(optimizer, dtype)[1]


def backward_peak_bytes(sizes: Sequence[int], in_flight: int, activation_per_sample: float,
                        workspace_per_sample: float, grads: float) -> float:
    """The most bytes above the model state while a step's micro-batches run (module docstring,
    "Peak of a training step"): over the backwards ``j = 0 .. m−1``,

        max_j ( G·[j ≥ 1] + a·Σ_{i=j}^{min(j+r, m)−1} s_i + t·s_j )

    ``sizes``: the micro-batches ``s_j`` in order; ``in_flight``: ``r``, micro-batches whose
    activations are alive when one's backward starts (1 without a pipeline; 1F1B ``min(S−k, m)``
    at stage ``k``; GPipe ``m``); ``a``, ``t``: saved activations and backward workspace per
    sample; ``G``: gradient bytes (allocated by the first backward, kept until ``zero_grad``)."""
    sizes = [int(s) for s in sizes if s > 0]
    m, r = len(sizes), max(int(in_flight), 1)
    best = 0.0
    for j in range(m):
        alive = sum(sizes[j:min(j + r, m)])
        best = max(best, (grads if j >= 1 else 0.0) + activation_per_sample * alive + workspace_per_sample * sizes[j])
    return best


def step_peak_bytes(*, weights: float, grads: float, optimizer_state: float, sizes: Sequence[int],
                    activation_per_sample: float, workspace_per_sample: float, in_flight: int = 1,
                    exchange: float = 0.0, buffers: float = 0.0) -> int:
    """Peak live tensor bytes of one rank over a steady-state training step (module docstring,
    "Peak of a training step"), one formula for every form:

        peak = W + O + H + max( max_j ( G·[j ≥ 1] + a·Σ_{i=j}^{j+r−1} s_i + t·s_j ),  G + X )

    ``weights`` W, ``optimizer_state`` O, ``grads`` G: the rank's own share; ``buffers`` H:
    runtime buffers kept across steps (a pipeline stage's per-micro-batch receive buffers);
    ``exchange`` X: gradient-exchange copies alive after the last backward (data parallelism's
    flattened buckets, one gradient's worth)."""
    during = backward_peak_bytes(sizes, in_flight, activation_per_sample, workspace_per_sample, grads)
    return int(weights + optimizer_state + buffers + max(during, grads + exchange))


def held_output_bytes_per_sample(graph: ModelGraph) -> float:
    """The model output per sample: the largest output of a node after the last repeated block
    that needs a gradient (a causal LM's logits, ``B·S·V`` elements).  fxpar's step loops drop
    the output object before the backward (autograd keeps the loss's own ``log_softmax`` copy),
    so it is not part of a rank's held activations; tensor parallelism sizes its vocab-parallel
    loss's workspace by it."""
    last_block = max((i for i, n in enumerate(graph.nodes) if n.layer is not None), default=-1)
    best = 0.0
    for n in graph.nodes[last_block + 1:]:
        if n.requires_grad and n.op_class is not OpClass.VIEW and n.out_shapes and n.out_shapes[0]:
            best = max(best, float(math.prod(n.out_shapes[0])) * _ITEMSIZE.get(n.dtype, 4))
    return best / float(graph.batch_size)
