"""Roofline cost model: time of every traced node on every device type.

For node ``n`` on device type ``d`` at precision ``p`` with relative speed ``s`` (1 for real GPUs):

    t_fwd(n, d) = max( F_fwd(n) / (η_c(d) · P_p(d)),  (R(n) + W(n)) / (η_mem(d) · BW(d)) ) / s
    t_bwd(n, d) = max( F_bwd(n) / (η_c(d) · P_p(d)),  2 (R(n) + W(n)) / (η_mem(d) · BW(d)) ) / s

``F`` are FLOPs, ``R``/``W`` bytes read/written, ``P_p`` the catalog peak at the job's precision,
``BW`` the memory bandwidth.  ``η_c`` is the device's ``matmul_efficiency`` for products and
``ATTENTION_EFFICIENCY_FACTOR`` × that for attention (attention kernels reach a smaller
fraction of peak than GEMMs — reference, "one speed ratio per op class"); pointwise nodes have
no FLOPs and are bound by memory.  The backward of a pointwise node reads the forward's inputs
and the incoming gradient and writes the input gradient, about twice the forward's traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpar.profiling import collectives, memory
from fxpar.tracing.graph import ModelGraph, OpClass

ATTENTION_EFFICIENCY_FACTOR = 0.75


@dataclass(frozen=True, slots=True)
class SampleCost:
    """Per-sample forward and backward seconds of the whole model on one device kind."""

    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


class CostModel:
    """Costs of a :class:`ModelGraph` on the devices of a :class:`~fxpar.cluster.Cluster`.

    Pure function of its inputs: arrays are built once, answers are cached per device kind.
    """

    def __init__(self, graph: ModelGraph, cluster, *, dtype: str = "fp32",
                 optimizer: str = "adam", allow_tf32: bool = False) -> None:
        self.graph = graph
        self.cluster = cluster
        self.dtype = dtype
        self.optimizer = optimizer
        self.compute_dtype = "tf32" if (dtype == "fp32" and allow_tf32) else dtype
        memory.state_bytes_per_param(optimizer, dtype)  # validates the optimizer name early
        nodes = [n for n in graph.nodes if n.op_class is not OpClass.VIEW]
        b = float(graph.batch_size)
        self._fwd = np.array([n.fwd_flops for n in nodes], dtype=np.float64) / b
        self._bwd = np.array([n.bwd_flops for n in nodes], dtype=np.float64) / b
        self._bytes = np.array([n.bytes_read + n.bytes_written for n in nodes], np.float64) / b
        self._is_attn = np.array([n.op_class is OpClass.ATTENTION for n in nodes])
        self._needs_bwd = np.array([n.requires_grad for n in nodes])
        self._cache: dict[tuple[str, float], SampleCost] = {}

    # ---- compute -------------------------------------------------------------------------
    def sample_cost(self, device) -> SampleCost:
        """Seconds per sample (forward, backward) on ``device`` (a Device or DeviceGroup)."""
        dtype_obj = device.type
        key = (dtype_obj.name, float(device.speed))
        if key not in self._cache:
            peak = dtype_obj.peak_tflops(self.compute_dtype) * 1e12
            eta = np.where(self._is_attn, dtype_obj.matmul_efficiency * ATTENTION_EFFICIENCY_FACTOR,
                           dtype_obj.matmul_efficiency)
            rate = eta * peak
            bw = dtype_obj.memory_efficiency * dtype_obj.memory_gbps * 1e9
            fwd = np.maximum(self._fwd / rate, self._bytes / bw).sum()
            bwd = np.where(self._needs_bwd, np.maximum(self._bwd / rate, 2 * self._bytes / bw), 0.0).sum()
            self._cache[key] = SampleCost(fwd_s=float(fwd) / device.speed, bwd_s=float(bwd) / device.speed)
        return self._cache[key]

    def flops_per_sample(self) -> float:
        return float(self._fwd.sum() + self._bwd.sum())

    # ---- memory --------------------------------------------------------------------------
    @property
    def param_count(self) -> int:
        return self.graph.param_count

    def state_bytes(self) -> int:
        """Weights + gradients + optimizer state of one replica."""
        return memory.model_state_bytes(self.param_count, self.optimizer, self.dtype)

    def activation_bytes_per_sample(self) -> float:
        return self.graph.activation_bytes / float(self.graph.batch_size)

    def gradient_bytes(self) -> int:
        return memory.gradient_bytes(self.param_count, self.optimizer, self.dtype)

    # ---- communication -------------------------------------------------------------------
    def allreduce_s(self, nbytes: float, ranks=None) -> float:
        return collectives.allreduce_time(collectives.ring_shape(self.cluster, ranks), nbytes)

    def allreduce_lower_bound_s(self, nbytes: float, ranks=None) -> float:
        return collectives.allreduce_lower_bound(collectives.ring_shape(self.cluster, ranks), nbytes)
