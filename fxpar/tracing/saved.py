"""Activation bytes a traced node keeps for the backward, as traced and under ``torch.autocast``.

One :class:`SavedBytes` per trace walks the exported graph's nodes in order and keeps two
ledgers: the tensors as traced (each at the dtype it was traced with) and the same tensors in a
mixed-precision step (fp32 master weights, forward under ``torch.autocast`` to bf16/fp16, what
:mod:`fxpar.runtime.precision` runs).  Each ledger counts a tensor once, by its first saver.

Which tensors a node saves (both ledgers): a node that needs a gradient and whose backward needs
its inputs (:func:`fxpar.tracing.op_costs.saves_inputs`) keeps each non-parameter tensor input
(a product ``a·b`` only the operands the other one's gradient needs: :func:`product_keeps`);
softmax keeps its output instead; attention (SDPA) keeps its inputs, output and log-sum-exp
(fp32, one per query row).  Two things the export shows differently from the eager step:

- **GQA**: HF builds an explicit causal mask while exporting, so its SDPA path repeats K and V to
  every query head (``unsqueeze → expand → reshape``); the eager training step (no padding
  mask) calls SDPA with ``enable_gqa`` on the un-repeated tensors, and that is what the kernel
  keeps.  K and V are counted at the size before the repeat (:func:`repeat_source`).
- **The attention output's layout**: flash and memory-efficient SDPA write their output in
  ``(B, S, H, D)`` order, so the ``transpose(1, 2).contiguous()`` and reshape that follow copy
  nothing, and the output projection keeps the tensor attention already keeps.

A dropout with ``p > 0`` in training keeps its mask: one byte per element (CUDA's fused dropout;
the CPU's keeps a scaled noise tensor in the input's dtype instead).  SDPA's own dropout keeps
only its random state (the flash kernel's; the CPU's math fallback keeps the probabilities).

Dtype of each tensor under autocast, ``d(n)`` (the CUDA op lists of ``torch.amp``; a model
traced in low precision is read as its fp32 master, so ``d`` is the same for both traces):

    parameters, buffers, floating inputs    fp32 (a traced bf16/fp16 reads as fp32)
    LOW ops (linear, matmul, bmm, conv, SDPA, einsum...)          low; fp32 inputs are *copied*
                                              to low for this op alone (autocast caches only the
                                              casts of parameters), so a hidden state read by the
                                              q, k and v projections is saved three times
    FP32 ops (softmax, log_softmax, layer_norm, pow, rsqrt, sum, cross_entropy...)  fp32; low
                                              inputs copied to fp32 for this op
    a dtype argument (``x.to(dtype)``, ``full(.., dtype=)``)      that dtype (traced low: fp32)
    anything else                             type promotion of its floating tensor inputs
                                              (dimensioned over 0-dim ones)

Saved bytes under autocast: the same tensors at ``d``'s size, each autocast copy once per op that
saves it.  The low-precision copies of the *weights* are one set per forward (autocast caches
them), not per sample: :mod:`fxpar.profiling.memory` counts them with the model state.  CPU
autocast keeps softmax, layer_norm and pow in their input's precision; the CUDA lists over-state
such a model's activations on the CPU a little (not Llama's: its norms upcast explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.tracing import op_costs

#: ops torch.autocast runs in the low-precision type (CUDA "lower_precision_fp" list, aten names)
LOW_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "addr", "mv", "einsum",
    "chain_matmul", "linalg_multi_dot", "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu"})
#: ops torch.autocast runs in fp32 (CUDA "fp32" list, aten names)
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "native_group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "softmax",
    "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss", "cumprod", "cumsum", "prod", "sum",
    "norm"})
#: the low-precision type's stand-in (fp16 has the same size)
LOW = torch.bfloat16
_LOW_TYPES = (torch.bfloat16, torch.float16)
#: ops that pass a view (or, for the attention output, a free relayout) of their first input on
_RELAYOUT = frozenset({"view", "_unsafe_view", "reshape", "transpose", "permute", "contiguous", "alias"})
_REPEAT = frozenset({"reshape", "view", "_unsafe_view", "expand", "unsqueeze"})


def tensor_vals(val: Any) -> list[torch.Tensor]:
    """The tensors of a node's ``meta['val']`` (one tensor, or a tuple/list of them)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def product_keeps(name: str, node: torch.fx.Node, needs_grad: dict[str, bool]) -> set[int] | None:
    """Which tensor operands a two-tensor product keeps for its backward (None: not a product,
    every operand).  ``a·b``: ∂/∂a = b and ∂/∂b = a, so ``a`` is kept only when ``b`` needs a
    gradient and vice versa (a rotary ``q·cos`` keeps ``cos``, never ``q``, when ``cos`` is a
    constant); ``a / b``: ∂/∂a = 1/b keeps ``b``, ∂/∂b = −a/b² keeps ``a`` and ``b``."""
    if name not in ("mul", "div") or len(node.args) < 2:
        return None
    a, b = node.args[:2]
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    grad_a, grad_b = needs_grad.get(a.name, False), needs_grad.get(b.name, False)
    if name == "mul":
        return {i for i, other in ((0, grad_b), (1, grad_a)) if other}
    return ({1} if grad_a or grad_b else set()) | ({0} if grad_b else set())


def repeat_source(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a GQA head repeat (``reshape(expand(unsqueeze(x)))``, HF's ``repeat_kv``)
    started from; ``node`` itself when it is not such a repeat."""
    cur, expanded = node, False
    while op_costs.op_name(cur.target) in _REPEAT and cur.args and isinstance(cur.args[0], torch.fx.Node):
        expanded = expanded or op_costs.op_name(cur.target) == "expand"
        cur = cur.args[0]
    return cur if expanded and cur is not node else node


def _dtype_arg(node: torch.fx.Node) -> torch.dtype | None:
    """The ``torch.dtype`` an op is given (``to(dtype)``, ``full(..., dtype=)``), if any."""
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


@dataclass
class _Ledger:
    """One accounting of saved tensors: the keys counted and the aliases (``same``)."""

    saved: set[str] = field(default_factory=set)
    same: dict[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        return self.same.get(name, name)


class SavedBytes:
    """Per-trace state for the saved-activation bytes of each node (module docstring).

    ``traced_low``: the low-precision dtype the model was traced in (its parameters'), read as
    fp32 under autocast; None for a model traced in fp32."""

    def __init__(self, traced_low: torch.dtype | None) -> None:
        self.traced_low = traced_low if traced_low in _LOW_TYPES else None
        self.amp: dict[str, torch.dtype] = {}      # node name -> its tensor's dtype under autocast
        self.attention: set[str] = set()           # attention nodes (their outputs' aliases)
        self.traced, self.mixed = _Ledger(), _Ledger()

    def _master(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype == self.traced_low else dtype

    def dtype_of(self, node: torch.fx.Node) -> torch.dtype | None:
        """``d(node)``: its tensor's dtype under autocast (None for a non-tensor)."""
        if node.name in self.amp:
            return self.amp[node.name]
        vals = tensor_vals(node.meta.get("val"))
        return self._master(vals[0].dtype) if vals else None

    def amp_dtype(self, node: torch.fx.Node, name: str) -> torch.dtype | None:
        """``d`` of a call's output (module docstring's table)."""
        vals = tensor_vals(node.meta.get("val"))
        if not vals:
            return None
        if not vals[0].is_floating_point():
            return vals[0].dtype
        if name in LOW_OPS:
            return LOW
        if name in FP32_OPS:
            return torch.float32
        explicit = _dtype_arg(node)
        if explicit is not None and explicit.is_floating_point:
            return self._master(explicit)
        if name == "type_as" and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node):
            return self.dtype_of(node.args[1])
        ins = [(self.dtype_of(a), a.meta["val"].dim() > 0) for a in node.all_input_nodes
               if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()]
        ranked = [d for d, dim in ins if dim and d is not None] or [d for d, _ in ins if d is not None]
        if not ranked:
            return self._master(vals[0].dtype)
        out = ranked[0]
        for d in ranked[1:]:
            out = torch.promote_types(out, d)
        return out

    def count(self, node: torch.fx.Node, name: str, *, attention: bool, is_view: bool, rg: bool,
              needs_grad: dict[str, bool], param_alias: dict[str, str]) -> tuple[int, int, str]:
        """``(traced bytes, autocast bytes, autocast dtype name)`` that ``node`` keeps for the
        backward beyond what earlier nodes keep (module docstring)."""
        d_out = self.amp_dtype(node, name)
        if d_out is not None:
            self.amp[node.name] = d_out
        if attention:
            self.attention.add(node.name)
        self._aliases(node, name)
        traced = self._count(self.traced, node, name, False, attention, is_view, rg, needs_grad, param_alias)
        mixed = self._count(self.mixed, node, name, True, attention, is_view, rg, needs_grad, param_alias)
        return traced, mixed, (str(d_out).replace("torch.", "") if d_out is not None else "")

    def _aliases(self, node: torch.fx.Node, name: str) -> None:
        """Nodes that return their input's tensor itself: dropout with p = 0 or in eval mode, a
        cast to the dtype the input has (per ledger: a bf16 trace's upcast is a no-op on the fp32
        master), and views / relayouts of an attention output (module docstring)."""
        first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if first is None:
            return
        for ledger, mixed in ((self.traced, False), (self.mixed, True)):
            src = ledger.key(first.name)
            if name in _RELAYOUT and src in self.attention:
                ledger.same[node.name] = src
            elif _returns_input(name, node, self.dtype_of(first) if mixed else None,
                                self.amp.get(node.name) if mixed else None):
                ledger.same[node.name] = src

    def _count(self, ledger: _Ledger, node: torch.fx.Node, name: str, mixed: bool, attention: bool,
               is_view: bool, rg: bool, needs_grad: dict[str, bool], param_alias: dict[str, str]) -> int:
        outs = tensor_vals(node.meta.get("val"))
        total = 0
        if rg and name in op_costs.SAVES_OUTPUT and outs and node.name not in ledger.saved:
            ledger.saved.add(node.name)  # softmax keeps its output (the next matmul reads the same tensor)
            total += self._size(outs[0], self.amp.get(node.name) if mixed else None)
        if rg and name == "dropout" and outs and not _returns_input(name, node):
            total += int(outs[0].numel())  # the keep-mask, one byte per element (CUDA's fused dropout)
        operands = sum(1 for a in node.args if isinstance(a, torch.fx.Node))
        if not (rg and not is_view and op_costs.saves_inputs(name, operands)):
            return total
        kept = product_keeps(name, node, needs_grad)
        for i, a in enumerate(node.args):
            if (isinstance(a, torch.fx.Node) and a.name not in param_alias
                    and isinstance(a.meta.get("val"), torch.Tensor) and (kept is None or i in kept)):
                key, nbytes = self._operand(ledger, node, name, i, a, mixed, attention)
                if key not in ledger.saved:
                    ledger.saved.add(key)
                    total += nbytes
        if attention and outs:
            ledger.saved.add(node.name)
            o = outs[0]
            total += self._size(o, self.amp.get(node.name) if mixed else None) \
                + int(o.numel() // max(1, o.shape[-1])) * 4  # out + lse (fp32)
        return total

    def _operand(self, ledger: _Ledger, node: torch.fx.Node, name: str, i: int, a: torch.fx.Node,
                 mixed: bool, attention: bool) -> tuple[str, int]:
        """The key and bytes of the tensor operand ``i`` is kept as: attention's K and V before
        a GQA repeat; under autocast, a LOW op's fp32 input (FP32 op's low input) is a copy of
        this op's own."""
        src = repeat_source(a) if attention and i in (1, 2) else a
        val = src.meta.get("val") if isinstance(src.meta.get("val"), torch.Tensor) else a.meta["val"]
        if not mixed:
            return ledger.key(src.name), int(val.numel()) * val.element_size()
        d = self.dtype_of(src)
        if d is None or not d.is_floating_point:
            return ledger.key(src.name), int(val.numel()) * val.element_size()
        if name in LOW_OPS and d not in _LOW_TYPES:
            return f"{node.name}:{i}", int(val.numel()) * LOW.itemsize
        if name in FP32_OPS and d in _LOW_TYPES:
            return f"{node.name}:{i}", int(val.numel()) * 4
        return ledger.key(src.name), int(val.numel()) * d.itemsize

    @staticmethod
    def _size(t: torch.Tensor, dtype: torch.dtype | None) -> int:
        return int(t.numel()) * (dtype.itemsize if dtype is not None else t.element_size())


def _returns_input(name: str, node: torch.fx.Node, in_dtype: torch.dtype | None = None,
                   out_dtype: torch.dtype | None = None) -> bool:
    """The op returns its first input itself: ``dropout(x, p, train)`` with ``p == 0`` or
    ``train`` False, ``x.to(dtype)`` to the dtype (and device) ``x`` already has — as traced, or
    under autocast when ``in_dtype`` / ``out_dtype`` (the input's and output's ``d``) are given."""
    if name == "dropout":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return (isinstance(p, (int, float)) and p == 0) or train is False
    if name == "to" and node.args and isinstance(node.args[0], torch.fx.Node):
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)) or node.kwargs.get("copy", False):
            return False
        same_dtype = (in_dtype == out_dtype) if in_dtype is not None else src.dtype == out.dtype
        return same_dtype and src.device == out.device
    return False
