"""FLOPs, bytes and saved-activation rules per aten operation.

Conventions (the same as ``torch.utils.flop_counter``): one fused multiply-add is 2 FLOPs;
only matrix products and attention count FLOPs, pointwise work is charged as memory traffic.

Forward FLOPs, for an output with ``M`` rows (all leading dims), inner size ``K``, ``N`` columns:

    linear / mm / addmm / matmul / bmm:   F = 2 · M · K · N
    conv (via torch.utils.flop_counter.conv_flop_count)
    grouped_mm (MoE experts, R routed rows): F = 2 · R · K · N   (only routed tokens count)
    scaled_dot_product_attention:         F = 2 · b·h·s_q·s_k·d_qk + 2 · b·h·s_q·s_k·d_v

Backward FLOPs: a product ``C = A·B`` costs ``2·M·K·N`` for ``dA`` if ``A`` needs a gradient and
the same for ``dB`` if ``B`` does (so 2x forward when both do, 1x for a first layer whose input
is data).  Attention backward recomputes the scores and runs four more products: 2.5x forward
(the same count as ``torch.utils.flop_counter.sdpa_backward_flop_count``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fxpar.tracing.graph import OpClass

# aten op names (overload packet, without the "aten." prefix) grouped by class.
_MATMUL = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution",
           "conv1d", "conv2d", "conv3d", "einsum", "grouped_mm_fallback", "_grouped_mm", "grouped_mm"}
_GROUPED = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
# Class-name endings of a mixture-of-experts block and its parts (Qwen3MoeSparseMoeBlock,
# MixtralExperts, MixtralTopKRouter, ...); the model / decoder-layer classes of MoE families
# (Qwen3MoeDecoderLayer) do not end so.
_MOE_SUFFIXES = ("SparseMoeBlock", "MoeBlock", "MoELayer", "MoeLayer", "Experts", "Router")
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}
_EMBEDDING = {"embedding"}
_NORM = {"mean", "sum", "var", "var_mean", "layer_norm", "native_layer_norm", "rms_norm",
         "softmax", "_softmax", "log_softmax", "_log_softmax", "group_norm", "batch_norm",
         "native_batch_norm", "_native_batch_norm_legit_no_training", "amax", "logsumexp"}
_LOSS = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss",
         "binary_cross_entropy_with_logits"}
#: ops that take an exponential (or a logarithm) of every element of their first input, row by
#: row: priced at a calibrated rate where exponentials outlast their memory traffic (a CPU)
SOFTMAX_ROWS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp", "cross_entropy_loss",
                          "binary_cross_entropy_with_logits"})
_VIEW = {"view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "expand_as",
         "slice", "select", "unsqueeze", "squeeze", "alias", "t", "flatten", "unflatten",
         "split", "split_with_sizes", "chunk", "unbind", "narrow", "detach", "view_as",
         "as_strided", "getitem", "_assert_tensor_metadata", "_assert_scalar", "sym_size",
         "sym_numel", "sym_stride", "lift_fresh_copy", "lift_fresh"}
# Ops whose backward needs none of their inputs (gradient passes straight through or is a
# constant scale): their inputs are not kept alive for backward on their account.
_NO_SAVE = {"add", "sub", "neg", "cat", "stack", "pad", "constant_pad_nd", "index", "gather",
            "repeat", "repeat_interleave", "embedding", "mean", "sum", "to", "_to_copy",
            "clone", "contiguous", "expand", "type_as", "dropout", "arange", "full", "ones",
            "zeros", "new_ones", "new_zeros", "empty", "empty_like"} | _VIEW


def op_namespace(target: Any) -> str:
    """``aten.linear.default`` -> ``aten``; ``transformers.grouped_mm_fallback`` -> ``transformers``."""
    return str(getattr(target, "namespace", "") or "")


def op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``linear``; ``operator.getitem`` -> ``getitem``."""
    name = getattr(target, "__name__", None) or str(target)
    packet = getattr(target, "overloadpacket", None)  # OpOverload's public packet (aten.linear)
    if packet is not None:
        name = packet.__name__
    name = name.split("::")[-1]
    return name.split(".")[-1] if "." in name else name


def stored_op_name(target: str) -> str:
    """:func:`op_name` of a target as an :class:`~fxpar.tracing.graph.OpNode` stores it, a string:
    ``aten.cross_entropy_loss.default`` -> ``cross_entropy_loss`` (the overload dropped)."""
    parts = target.split(".")
    return parts[-2] if len(parts) >= 3 else parts[-1]


# Token dispatch / combine ops of an MoE layer (sorting tokens by expert, counting, gathering).
_ROUTING_OPS = {"topk", "sort", "argsort", "histc", "bincount", "cumsum", "index", "index_put",
                "index_put_", "index_add", "index_add_", "scatter", "scatter_add", "scatter_add_",
                "gather", "one_hot", "nonzero", "where", "floor_divide", "softmax", "_softmax",
                "div", "div_", "sum", "empty_like", "arange"}


def refine_class(cls: OpClass, namespace: str, module_types: list[str], module_path: str,
                 name: str) -> OpClass:
    """MoE and collective classes from the op's namespace and enclosing module classes.

    Inside an MoE layer: the experts' products are MOE_EXPERTS; the router's product and the
    dispatch/combine ops (top-k, sort, histc, index, ...) are MOE_ROUTING; the experts'
    pointwise math (activation, gating multiply) keeps its class.
    """
    if namespace in _COLLECTIVE_NAMESPACES:
        return OpClass.COLLECTIVE
    if cls is OpClass.VIEW or not any(t.endswith(_MOE_SUFFIXES) for t in module_types):
        return cls
    in_experts = any("Experts" in t for t in module_types) or ".experts" in module_path
    if cls is OpClass.MATMUL:
        return OpClass.MOE_EXPERTS if in_experts else OpClass.MOE_ROUTING
    if name in _ROUTING_OPS:
        return OpClass.MOE_ROUTING
    return cls


def classify(name: str) -> OpClass:
    """The :class:`OpClass` of an aten op name."""
    if name in _MATMUL:
        return OpClass.MATMUL
    if name in _ATTENTION:
        return OpClass.ATTENTION
    if name in _EMBEDDING:
        return OpClass.EMBEDDING
    if name in _NORM or name in ("pow", "rsqrt", "sqrt"):
        return OpClass.NORM if name in _NORM else OpClass.ELEMENTWISE
    if name in _LOSS:
        return OpClass.LOSS
    if name in _VIEW:
        return OpClass.VIEW
    return OpClass.ELEMENTWISE


#: ops whose backward needs their *output* rather than their input (d softmax = f(softmax))
SAVES_OUTPUT = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
#: products whose backward needs only the *other* operand: by a Python scalar, nothing
_SCALAR_PRODUCT = frozenset({"mul", "div"})


def saves_inputs(name: str, tensor_operands: int = 2) -> bool:
    """Whether an op keeps its (non-parameter) inputs alive for the backward pass
    (``tensor_operands``: how many of its arguments are tensors; a product with a Python
    scalar keeps nothing)."""
    if name in SAVES_OUTPUT or (name in _SCALAR_PRODUCT and tensor_operands < 2):
        return False
    return name not in _NO_SAVE


def _prod(xs: Sequence[int]) -> int:
    return int(math.prod(int(x) for x in xs))


def matmul_flops(name: str, shapes: list[tuple[int, ...] | None],
                 out_shape: tuple[int, ...] | None) -> tuple[int, tuple[int, int]]:
    """Forward FLOPs of a product and the backward FLOPs for (first operand, second operand).

    ``shapes`` are the shapes of the tensor arguments in call order (None for non-tensors).
    """
    if out_shape is None:
        return 0, (0, 0)
    if name == "linear":
        x, w = shapes[0], shapes[1]
        if x is None or w is None:
            return 0, (0, 0)
        k = int(w[-1])
    elif name in ("addmm", "baddbmm"):
        a = shapes[1]
        if a is None:
            return 0, (0, 0)
        k = int(a[-1])
    elif name in _GROUPED:
        a = shapes[0]
        if a is None:
            return 0, (0, 0)
        k = int(a[-1])
    elif name in ("mm", "bmm", "matmul"):
        a = shapes[0]
        if a is None:
            return 0, (0, 0)
        k = int(a[-1]) if len(a) > 1 else int(a[0])
    else:
        return 0, (0, 0)
    flops = 2 * _prod(out_shape) * k
    return flops, (flops, flops)


def conv_flops(shapes: list[tuple[int, ...] | None], out_shape: tuple[int, ...] | None,
               transposed: bool) -> int:
    """Forward FLOPs of a convolution, by torch's public formula."""
    from torch.utils.flop_counter import conv_flop_count

    x, w = shapes[0], shapes[1]
    if x is None or w is None or out_shape is None:
        return 0
    return int(conv_flop_count(list(x), list(w), list(out_shape), transposed=transposed))


def attention_flops(shapes: list[tuple[int, ...] | None]) -> int:
    """Forward FLOPs of scaled dot-product attention: ``QKᵀ`` and ``P·V``."""
    q, k, v = shapes[0], shapes[1], shapes[2]
    if q is None or k is None or v is None or len(q) < 3:
        return 0
    b_h = _prod(q[:-2])
    s_q, d_qk = int(q[-2]), int(q[-1])
    s_k, d_v = int(k[-2]), int(v[-1])
    return 2 * b_h * s_q * s_k * d_qk + 2 * b_h * s_q * s_k * d_v


ATTENTION_BACKWARD_FACTOR = 2.5

#: convolution ops (their FLOPs by :func:`conv_flops`; the other products by :func:`matmul_flops`)
CONVOLUTIONS = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d"})


#: a GPU's fastest 2-byte products need every matrix dimension a multiple of this many elements
#: (rows of 16 bytes: NVIDIA's tensor-core alignment for fp16 and bf16)
ALIGNMENT_ELEMENTS = 8


def unaligned_product(op_class: OpClass, target: str, in_shapes: Sequence[Sequence[int]]) -> bool:
    """Whether a matrix product has a dimension that is not a multiple of
    :data:`ALIGNMENT_ELEMENTS`: the inner size of its first matrix operand (its last dimension)
    or either dimension of another operand's matrix (their last two: a linear's ``N x K`` weight,
    a 50257-word head's among them).  A first operand's rows (a micro-batch's tokens) and batch
    dimensions are not counted; convolutions are not products of this kind."""
    if op_class is not OpClass.MATMUL or stored_op_name(target) in CONVOLUTIONS:
        return False
    matrices = [tuple(s) for s in in_shapes if len(s) >= 2]
    if not matrices:
        return False
    dims = [matrices[0][-1]] + [d for shape in matrices[1:] for d in shape[-2:]]
    return any(int(d) % ALIGNMENT_ELEMENTS for d in dims)


def node_flops(name: str, base_cls: OpClass, cls: OpClass, shapes: list[tuple[int, ...] | None],
               out_shape: tuple[int, ...] | None, *, operand_grads: Sequence[bool], rg: bool,
               transposed: bool = False) -> tuple[int, int]:
    """(forward, backward) FLOPs of one op, exported or recorded: a product or convolution by its
    shapes, the backward counting the gradient of each operand that needs one (``operand_grads``:
    input and weight for a convolution, the two factors of a product); attention
    ``ATTENTION_BACKWARD_FACTOR`` × its forward when it needs a gradient (``rg``); (0, 0) for
    every other op (charged as memory traffic)."""
    fwd = bwd = 0
    if base_cls is OpClass.MATMUL:
        if name in CONVOLUTIONS:
            fwd = conv_flops(shapes, out_shape, transposed)
            bwd = fwd * sum(1 for g in operand_grads[:2] if g)
        else:
            fwd, (b_first, b_second) = matmul_flops(name, shapes, out_shape)
            bwd = (b_first if operand_grads and operand_grads[0] else 0) + \
                (b_second if len(operand_grads) > 1 and operand_grads[1] else 0)
    elif cls is OpClass.ATTENTION:
        fwd = attention_flops(shapes)
        bwd = int(ATTENTION_BACKWARD_FACTOR * fwd) if rg else 0
    return fwd, bwd
