"""The predicted step of expert parallelism for MoE models: batch shares *and* experts per device,
priced as plain numbers (:func:`evaluate`).  The solver that chooses them is
:mod:`fxpar.solvers.expert_plan`; the data come from a CostModel by
:func:`fxpar.sim.expert_costs.build_problem`; :func:`fxpar.forms.expert.price.simulate` turns the phases into a
timeline.

Every rank holds the replicated part (attention, norms, router, embeddings, head), trains on its
batch share ``s_r`` and owns ``x_r`` of the ``E`` experts of every MoE layer (contiguous ranges,
:mod:`fxpar.forms.expert.apply_module`).  Routing is taken as uniform: each expert receives ``1/E``
of the global token-to-expert assignments, so a rank's expert work depends on ``x_r`` alone.

Data (per device group ``g`` = type, speed, memory; from the CostModel by
:func:`fxpar.sim.expert_costs.build_problem`):
    c_g, f_g      replicated part: seconds per sample, per micro-batch (nodes outside ``*.experts``)
    c'_g, f'_g    expert part: seconds for one sample's assignments to all experts; launch seconds
                  per owned expert and micro-batch (MOE_EXPERTS + pointwise nodes in ``*.experts``)
    o_g           optimizer seconds per parameter; P replicated parameters, p per expert
    M_g           memory; S replicated state + all-reduce buffer; m state of one expert (all layers)
    a, a'         activation bytes per sample: replicated part (+ backward workspace), expert part
    D             bytes one sample moves through all all-to-alls of a step: its assignments ×
                  hidden × itemsize × MoE layers × 4 (dispatch + combine, forward + backward)
    α             per micro-batch: 4 all-to-all latencies + 1 count all-gather per MoE layer,
                  and the runtime's calibrated cost of each of these 5 synchronising calls
                  (``expert_call_s``, :mod:`fxpar.calibrate.runtime_probe`)
    β_j, β_nic    seconds per byte of node j's intra-node link (per device) and of a node's NIC
    AR            all-reduce of the replicated gradients only (expert gradients stay local)
    B, E, k       global batch, experts per layer, micro-batches (the same k on every rank)

Predicted step (:func:`evaluate`).  The dispatch/combine all-to-alls are barriers between the
replicated part and the experts in every layer, so the phases' maxima add up (exact when the
ranks' per-layer times are proportional, as they are here):
    R_r = k f_g + c_g s_r            X_r = x_r (k f'_g + B c'_g / E)        (r in group g)
    φ_r = s_r/B, node j ∋ r: Φ_j = Σ_{q∈j} φ_q, X_j = Σ_{q∈j} x_q, K = B·D
    nic_j = β_nic K max(Φ_j (1 − X_j/E), (X_j/E)(1 − Φ_j))        tokens leaving / entering j
    in_r  = β_j K max(φ_r (X_j − x_r)/E, (x_r/E)(Φ_j − φ_r))       inside node j
    A_r   = k α + max(nic_j, in_r)
    step  = max_r R_r + max_r X_r + max_r A_r + AR + max_r o_g (P + p x_r) + L
            (L the step loop's own seconds: :meth:`fxpar.profiling.CostModel.step_overhead_s`)
    mem_r = S + m x_r + a ⌈s_r/k⌉ + a' (x_r/E) Σ_q ⌈s_q/k⌉  ≤  M_g      (the solver's bound)
    as simulated: the one peak formula (:func:`rank_peak_bytes`): gradients exist from the
    first backward on, the all-reduce buckets X only after the last, the workspace t only
    during a backward
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fxpar.profiling import memory

PASSES = 4  # all-to-alls per MoE layer and step: dispatch + combine, forward and backward


@dataclass(frozen=True, slots=True)
class EPGroup:
    key: str
    ranks: tuple[int, ...]
    sample_s: float            # c_g
    fixed_s: float             # f_g
    expert_sample_s: float     # c'_g
    expert_fixed_s: float      # f'_g
    optimizer_s_per_param: float
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class EPProblem:
    """Everything the shares + placement search needs, as plain numbers (module docstring)."""

    groups: tuple[EPGroup, ...]
    nodes: tuple[tuple[int, ...], ...]      # ranks of each node
    intra_s_per_byte: tuple[float, ...]     # β_j per node
    nic_s_per_byte: float                   # β_nic (0 on one node)
    global_batch: int
    num_experts: int
    routed_bytes_per_sample: float          # D
    a2a_fixed_s: float                      # α
    state_bytes: int                        # S
    expert_state_bytes: int                 # m
    activation_bytes_per_sample: float      # a
    expert_activation_bytes_per_sample: float  # a'
    replicated_params: int                  # P
    expert_params: int                      # p
    allreduce_s: float                      # AR
    max_microbatches: int | None = None
    #: the peak formula's parts (0: S and a hold everything, the simple sum below): gradient
    #: bytes per parameter g; X the replicated gradients' all-reduce buckets (inside S); t the
    #: backward workspace per sample (inside a)
    grad_bytes_per_param: float = 0.0
    exchange_bytes: float = 0.0
    workspace_bytes_per_sample: float = 0.0
    step_overhead_s: float = 0.0            # L, the step loop's own seconds (calibrated)

    @property
    def world(self) -> int:
        return sum(len(g.ranks) for g in self.groups)

    def group_of(self) -> list[int]:
        out = [0] * self.world
        for gi, g in enumerate(self.groups):
            for r in g.ranks:
                out[r] = gi
        return out


@dataclass(frozen=True, slots=True)
class EPEval:
    shares: tuple[int, ...]
    counts: tuple[int, ...]
    k: int
    step_s: float
    replicated_s: float          # max_r R_r
    expert_s: float              # max_r X_r
    alltoall_s: float            # max_r A_r
    allreduce_s: float
    optimizer_s: float           # max_r
    busy_s: tuple[float, ...]    # R_r + X_r + optimizer
    phases: tuple[tuple[float, float, float], ...]  # (R_r, X_r, optimizer) per rank
    memory_bytes: tuple[int, ...]
    fits: bool


def rank_state_bytes(p: EPProblem, x: int) -> float:
    """``W + O`` of a rank holding ``x`` experts (:func:`rank_peak_bytes`): its state less its
    gradients and the all-reduce's buffers."""
    grads = p.grad_bytes_per_param * (p.replicated_params + p.expert_params * x)
    return p.state_bytes - p.exchange_bytes + p.expert_state_bytes * x - grads


def rank_peak_bytes(p: EPProblem, x: int, micro: int, k: int, total_micro: int) -> int:
    """A rank's peak (module docstring, ``mem_r``) by :func:`fxpar.profiling.memory.step_peak_bytes`:
    W + O = S − X − g·P + (m − g·p)·x,  G = g·(P + p·x),  k micro-batches of ⌈s_r/k⌉ samples, each
    sample's activations a − t + a'·(x/E)·Σ_q ⌈s_q/k⌉ / ⌈s_r/k⌉ (the experts' tokens come from
    every rank's micro-batch), workspace t."""
    g = p.grad_bytes_per_param
    grads = g * (p.replicated_params + p.expert_params * x)
    held = rank_state_bytes(p, x)
    act = p.activation_bytes_per_sample - p.workspace_bytes_per_sample
    act += p.expert_activation_bytes_per_sample * x / p.num_experts * total_micro / max(micro, 1)
    return memory.step_peak_bytes(weights=held, grads=grads, optimizer_state=0.0, sizes=[micro] * k,
                                  activation_per_sample=act, workspace_per_sample=p.workspace_bytes_per_sample,
                                  exchange=p.exchange_bytes)


def valid_share(s: int, k: int) -> bool:
    """Whether ``k`` micro-batches of ``⌈s/k⌉`` samples (what codegen runs) are all non-empty."""
    return s >= k and (k - 1) * -(-s // k) < s


def evaluate(p: EPProblem, shares, counts, k: int) -> EPEval:
    """The predicted step of integer shares and expert counts with ``k`` micro-batches."""
    B, E, K = p.global_batch, p.num_experts, p.global_batch * p.routed_bytes_per_sample
    gi = p.group_of()
    micro = [math.ceil(s / k) for s in shares]
    total_micro = sum(micro)
    R, X, O, A, mem = [], [], [], [], []  # A in node order: only its maximum is used
    for r, (s, x) in enumerate(zip(shares, counts)):
        g = p.groups[gi[r]]
        R.append(k * g.fixed_s + g.sample_s * s)
        X.append(x * (k * g.expert_fixed_s + B * g.expert_sample_s / E))
        O.append(g.optimizer_s_per_param * (p.replicated_params + p.expert_params * x))
        mem.append(rank_peak_bytes(p, x, micro[r], k, total_micro))
    for j, ranks in enumerate(p.nodes):
        Phi, Xj = sum(shares[r] for r in ranks) / B, sum(counts[r] for r in ranks)
        nic = p.nic_s_per_byte * K * max(Phi * (1 - Xj / E), Xj / E * (1 - Phi))
        for r in ranks:
            phi, x = shares[r] / B, counts[r]
            inside = p.intra_s_per_byte[j] * K * max(phi * (Xj - x) / E, x / E * (Phi - phi))
            A.append(k * p.a2a_fixed_s + max(nic, inside))
    ok = all(valid_share(s, k) for s in shares) and sum(shares) == B
    ok = ok and sum(counts) == E and all(m <= p.groups[gi[r]].memory_bytes for r, m in enumerate(mem))
    step = max(R) + max(X) + max(A) + p.allreduce_s + max(O) + p.step_overhead_s
    return EPEval(shares=tuple(shares), counts=tuple(counts), k=k, step_s=step, replicated_s=max(R),
                  expert_s=max(X), alltoall_s=max(A), allreduce_s=p.allreduce_s, optimizer_s=max(O),
                  busy_s=tuple(a + b + c for a, b, c in zip(R, X, O)), phases=tuple(zip(R, X, O)),
                  memory_bytes=tuple(mem), fits=ok)
