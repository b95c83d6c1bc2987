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
A (log-)softmax or a loss over logits (``SOFTMAX_ROWS``) takes an exponential of every element
``E(n)`` of its input; where a calibration measured that rate, ``σ`` elements/s
(``softmax_elements_per_s``: on a CPU exponentials outlast the memory traffic), each pass costs at
least ``E(n) / σ``, forward and backward alike.  A product with a dimension that is not a
multiple of 8 elements (:func:`fxpar.tracing.op_costs.unaligned_product`: a 50257-word head)
runs at ``P_u``, the calibration's ``matmul_unaligned_flops``, where it measured one (a GPU's
2-byte products leave the tensor cores' fastest kernels); elsewhere at ``η_c P_p``.  These are a node's seconds at the traced batch
``b`` (its FLOPs, bytes and elements as traced).

A micro-batch of ``B`` samples is priced affine, ``a_n + c_n · B``,
exact at ``B = b``: the bytes of the parameters a node reads (``Q(n)``: its weights, read once
per micro-batch whatever ``B`` is) do not grow with the batch, the rest does, so

    c_fwd(n) = max( F_fwd(n) / (η_c P_p),  (R(n) + W(n) − Q(n)) / (η_mem BW) ) / b
    a_fwd(n) = overhead + max(0, t_fwd(n, d) − b · c_fwd(n))        (backward alike, 2× the bytes)

A node compute-bound at ``b`` is unchanged (``a`` the overhead, ``c = t / b``); a memory-bound
one whose traffic is mostly weights (an embedding table, a large head at one sample) pays them
once per micro-batch, not once per sample.  Every non-view node pays ``OP_OVERHEAD_S`` per
launch (eager dispatch + kernel launch, an estimate (U)), so the cost of a micro-batch of ``B``
samples is affine:

    t(B) = A + C · B,   A = Σ_n a_n,   C = Σ_n c_n

Measured profiles (:mod:`fxpar.profiling.database`) replace the roofline node by node wherever
the graph's batch-normalised key is in the device type's database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fxpar.dtype_policy import DtypePolicy
from fxpar.profiling import collectives, memory
from fxpar.profiling.database import ProfileDB
from fxpar.profiling.network import Network, network_of, scaled_link, scaled_shape
from fxpar.tracing.graph import ModelGraph, OpClass
from fxpar.tracing.op_costs import SOFTMAX_ROWS, stored_op_name, unaligned_product

ATTENTION_EFFICIENCY_FACTOR = 0.75
OP_OVERHEAD_S = 5e-6


@dataclass(frozen=True, slots=True)
class SampleCost:
    """Affine cost of the whole model on one device kind: ``t(B) = fixed + per_sample · B``."""

    fwd_s: float                 # per sample
    bwd_s: float                 # per sample
    fwd_fixed_s: float = 0.0     # per micro-batch
    bwd_fixed_s: float = 0.0
    measured_fraction: float = 0.0   # share of nodes whose cost came from a measured profile
    weights_s: float = 0.0       # of the fixed seconds, the roofline's weight traffic (module docstring)

    @property
    def total_s(self) -> float:
        """Marginal seconds per sample (forward + backward)."""
        return self.fwd_s + self.bwd_s

    @property
    def fixed_s(self) -> float:
        """Seconds per micro-batch independent of its size (forward + backward)."""
        return self.fwd_fixed_s + self.bwd_fixed_s

    def microbatch_s(self, batch: float) -> float:
        return self.fixed_s + self.total_s * batch


@dataclass(frozen=True)
class NodeCosts:
    """Per-node affine costs (seconds; ``a`` per micro-batch, ``c`` per sample), graph order."""

    fwd_a: np.ndarray
    fwd_c: np.ndarray
    bwd_a: np.ndarray
    bwd_c: np.ndarray
    measured: np.ndarray      # bool: cost came from a measured profile
    weights: np.ndarray       # of ``fwd_a + bwd_a``, the seconds of weight traffic (module docstring)
    #: of ``fwd_a`` / ``bwd_a``, the per-op launch seconds (the calibrated op overhead; a measured
    #: node's intercept at most): tensor parallelism divides a node's work, never its launch
    #: (:meth:`fxpar.sim.segments.SegmentTable.stage_seconds`); None: none counted apart
    fwd_o: np.ndarray | None = None
    bwd_o: np.ndarray | None = None


def optimizer_key(optimizer: str, dtype: str) -> str:
    """Profile-database key of an optimizer step (cost affine in the parameter count)."""
    family = {"adam": "adam", "adamw": "adam", "fused_adamw": "fused_adam"}.get(optimizer, "sgd")
    return f"optimizer|{family}|{dtype}"


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}.get(dtype, 4)


class CostModel:
    """Costs of a :class:`ModelGraph` on the devices of a :class:`~fxpar.cluster.Cluster`.

    Pure function of its inputs: arrays are built once, answers are cached per device kind."""

    def __init__(self, graph: ModelGraph, cluster, *, dtype: str = "fp32",
                 optimizer: str = "adam", allow_tf32: bool = False,
                 profiles: Mapping[str, ProfileDB] | None = None) -> None:
        # mixed precision: activations as torch.autocast keeps them (fxpar.tracing.saved)
        self.graph = graph.under_autocast() if dtype in ("fp16", "bf16") else graph
        self.cluster = cluster
        self.dtype = dtype
        self.optimizer = optimizer
        self.compute_dtype = "tf32" if (dtype == "fp32" and allow_tf32) else dtype
        memory.state_bytes_per_param(optimizer, dtype)  # validates the optimizer name early
        self.profiles = dict(profiles or {})
        nodes = self.graph.nodes
        self._keys = list(graph.op_keys)
        b = float(graph.batch_size)
        self._fwd = np.array([n.fwd_flops for n in nodes], dtype=np.float64) / b
        self._bwd = np.array([n.bwd_flops for n in nodes], dtype=np.float64) / b
        self._bytes = np.array([n.bytes_read + n.bytes_written for n in nodes], np.float64) / b
        param_bytes = {p.fqn: p.nbytes for p in graph.params}
        weights = np.array([min(n.bytes_read, sum(param_bytes.get(f, 0) for f in n.param_fqns)) for n in nodes],
                           dtype=np.float64)
        self._sample_bytes = self._bytes - weights / b      # the traffic that grows with the batch
        self._traced = b
        self._elements = np.array([float(np.prod(n.in_shapes[0])) if n.in_shapes and stored_op_name(n.target) in SOFTMAX_ROWS
                                   else 0.0 for n in nodes], dtype=np.float64) / b   # per sample
        self._is_attn = np.array([n.op_class is OpClass.ATTENTION for n in nodes], dtype=bool)
        self._unaligned = np.array([unaligned_product(n.op_class, n.target, n.in_shapes) for n in nodes], dtype=bool)
        self._is_view = np.array([n.op_class is OpClass.VIEW for n in nodes], dtype=bool)
        self._needs_bwd = np.array([n.requires_grad for n in nodes], dtype=bool)
        self._cache: dict[tuple[str, float], SampleCost] = {}
        self._node_cache: dict[tuple[str, float], NodeCosts] = {}

    # ---- compute -------------------------------------------------------------------------
    def node_costs(self, device) -> NodeCosts:
        """Per-node affine costs on ``device`` (a Device or DeviceGroup): measured where the
        device type's profile has the node's key, roofline elsewhere; divided by its speed."""
        dtype_obj = device.type
        key = (dtype_obj.name, float(device.speed))
        if key in self._node_cache:
            return self._node_cache[key]
        db = self.profiles.get(dtype_obj.name)
        matmul, bw, overhead = self._rates(dtype_obj, db)
        softmax = self.softmax_rate(device)
        rate = np.where(self._is_attn, matmul * ATTENTION_EFFICIENCY_FACTOR, matmul)
        unaligned = self.unaligned_rate(device)
        if unaligned:
            rate = np.where(self._unaligned, unaligned, rate)
        real = ~self._is_view
        b = self._traced   # the roofline at the traced batch, t / b, and its part that grows with the batch
        exp = self._elements / softmax if softmax else np.zeros_like(self._elements)
        fwd_t = np.maximum.reduce([self._fwd / rate, self._bytes / bw, exp])
        bwd_t = np.maximum.reduce([self._bwd / rate, 2 * self._bytes / bw, exp])
        fwd_c = np.where(real, np.maximum.reduce([self._fwd / rate, self._sample_bytes / bw, exp]), 0.0)
        bwd_c = np.where(real & self._needs_bwd, np.maximum.reduce([self._bwd / rate, 2 * self._sample_bytes / bw, exp]),
                         0.0)
        fwd_w = np.where(real, b * np.maximum(fwd_t - fwd_c, 0.0), 0.0)
        bwd_w = np.where(real & self._needs_bwd, b * np.maximum(bwd_t - bwd_c, 0.0), 0.0)
        fwd_o = np.where(real, overhead, 0.0)
        bwd_o = np.where(real & self._needs_bwd, overhead, 0.0)
        fwd_a = fwd_o + fwd_w
        bwd_a = bwd_o + bwd_w
        weights = fwd_w + bwd_w
        measured = np.zeros(len(fwd_c), dtype=bool)
        if db is not None and self._keys:
            # measured nodes replace their roofline estimate; views count too (they cost
            # dispatch time on a real device); nodes missing from the database keep roofline
            for i, k in enumerate(self._keys):
                cost = db.ops.get(k)
                if cost is not None:
                    measured[i] = True
                    fwd_a[i], fwd_c[i], bwd_a[i], bwd_c[i] = cost.fwd[0], cost.fwd[1], cost.bwd[0], cost.bwd[1]
                    weights[i] = 0.0
                    fwd_o[i], bwd_o[i] = min(fwd_o[i], max(fwd_a[i], 0.0)), min(bwd_o[i], max(bwd_a[i], 0.0))
        sp = device.speed
        result = NodeCosts(fwd_a=fwd_a / sp, fwd_c=fwd_c / sp, bwd_a=bwd_a / sp, bwd_c=bwd_c / sp,
                           measured=measured, weights=weights / sp, fwd_o=fwd_o / sp, bwd_o=bwd_o / sp)
        self._node_cache[key] = result
        return result

    def softmax_rate(self, device) -> float | None:
        """Elements/s of a softmax pass on ``device``'s type, where its calibration measured it
        (module docstring), before its speed; None: priced by its memory traffic alone."""
        db = self.profiles.get(device.type.name)
        return db.softmax_elements_per_s if db is not None else None

    def unaligned_rate(self, device) -> float | None:
        """FLOP/s of a product with a dimension that is not a multiple of 8 elements at the job's
        precision on ``device``'s type, where its calibration measured it (module docstring),
        before its speed; None: priced as an aligned one."""
        db = self.profiles.get(device.type.name)
        return db.matmul_unaligned_flops.get(self.compute_dtype) if db is not None else None

    def rates(self, device) -> tuple[float, float, float]:
        """(matrix-product FLOP/s at the job's precision, memory bytes/s, seconds per launched op)
        the pricing uses on ``device``'s type (:meth:`_rates`), before its speed."""
        return self._rates(device.type, self.profiles.get(device.type.name))

    def _rates(self, device_type, db: ProfileDB | None) -> tuple[float, float, float]:
        """(matrix-product FLOP/s, memory bytes/s, seconds per op) on ``device_type``: a
        calibration's measured rates where its profile has them (``fxpar calibrate``), else the
        catalog's peak times its efficiency and the roofline's per-op estimate."""
        catalog = device_type.matmul_efficiency * device_type.peak_tflops(self.compute_dtype) * 1e12
        matmul = catalog
        bw = device_type.memory_efficiency * device_type.memory_gbps * 1e9
        overhead = OP_OVERHEAD_S
        if db is not None:
            measured = db.matmul_flops.get(self.compute_dtype)
            matmul = measured if measured else catalog
            bw = db.memory_bytes_per_s or bw
            overhead = db.op_overhead_s if db.op_overhead_s is not None else overhead
        return matmul, bw, overhead

    def sample_cost(self, device) -> SampleCost:
        """The whole model's affine cost on ``device`` (sums of :meth:`node_costs`)."""
        key = (device.type.name, float(device.speed))
        if key not in self._cache:
            nc = self.node_costs(device)
            self._cache[key] = SampleCost(
                fwd_s=float(nc.fwd_c.sum()), bwd_s=float(nc.bwd_c.sum()),
                fwd_fixed_s=float(nc.fwd_a.sum()), bwd_fixed_s=float(nc.bwd_a.sum()),
                measured_fraction=float(nc.measured.mean()) if len(nc.measured) else 0.0,
                weights_s=float(nc.weights.sum()))
        return self._cache[key]

    # ---- memory --------------------------------------------------------------------------
    @property
    def param_count(self) -> int:
        return self.graph.param_count

    def state_bytes(self) -> int:
        """Weights + gradients + optimizer state of one replica."""
        return memory.model_state_bytes(self.param_count, self.optimizer, self.dtype)

    def activation_bytes_per_sample(self, checkpointing: bool = False) -> float:
        """Saved activations per sample.  With activation checkpointing of every repeated block:
        each block keeps only its input (the previous block's last output), the block being
        recomputed holds its full activations, and nodes outside blocks keep theirs:

            A_ckpt = Σ_outside saved + Σ_blocks boundary + max_block saved
        """
        b = float(self.graph.batch_size)
        if not checkpointing or not self.graph.layers:
            return self.graph.activation_bytes / b
        outside = sum(n.saved_bytes for n in self.graph.nodes if n.layer is None)
        per_block: dict[int, int] = {}
        boundary: dict[int, int] = {}
        for n in self.graph.nodes:
            if n.layer is None:
                continue
            per_block[n.layer] = per_block.get(n.layer, 0) + n.saved_bytes
            if n.out_shapes and n.op_class is not OpClass.VIEW:
                boundary[n.layer] = int(np.prod(n.out_shapes[0])) * _itemsize(n.dtype)
        return (outside + sum(boundary.values()) + max(per_block.values(), default=0)) / b

    def optimizer_s(self, device) -> float:
        """One optimizer step on ``device``: measured per parameter where profiled, else the
        update's memory traffic at the device's bandwidth.  Not divided by an emulated speed:
        the emulator stretches forward and backward only."""
        db = self.profiles.get(device.type.name)
        cost = None if db is None else db.ops.get(optimizer_key(self.optimizer, self.dtype))
        if cost is not None:
            return cost.fwd_s(self.param_count)
        traffic = memory.optimizer_traffic_bytes_per_param(self.optimizer, self.dtype) * self.param_count
        return traffic / (device.type.memory_efficiency * device.type.memory_gbps * 1e9)

    def transient_bytes_per_sample(self) -> float:
        """Backward workspace: the gradient and a temporary of the largest single output.  Views
        allocate nothing (and a view of a parameter, such as the transposed expert weights of an
        MoE layer, does not grow with the batch), so they are left out."""
        largest = max((sum(int(np.prod(sh)) for sh in n.out_shapes) * _itemsize(n.dtype)
                       for n in self.graph.nodes if n.requires_grad and n.op_class is not OpClass.VIEW),
                      default=0)
        return 2.0 * largest / float(self.graph.batch_size)

    def gradient_bytes(self) -> int:
        """Gradient bytes of one replica as memory holds them (:mod:`fxpar.profiling.memory`)."""
        return memory.gradient_bytes(self.param_count, self.optimizer, self.dtype)

    # ---- what crosses the wire ---------------------------------------------------------------
    def policy(self, policy: DtypePolicy | None = None) -> DtypePolicy:
        """``policy``, or the default dtype policy of this cost model's dtype (what the planner's
        plans run with)."""
        return policy if policy is not None else DtypePolicy.for_dtype(self.dtype)

    def gradient_wire_bytes(self, policy: DtypePolicy | None = None) -> float:
        """Bytes of the gradients data parallelism sums each step, as the runtime sends them:
        every parameter in the policy's ``reduce_dtype`` (fp32 by default in every precision, as
        DDP sums the fp32 gradients of an autocast model)."""
        return float(self.param_count * self.policy(policy).reduce_bytes)

    def gather_itemsizes(self, policy: DtypePolicy | None = None) -> dict[str, int]:
        """Per parameter (FQN), the bytes per element sharded data parallelism all-gathers it in:
        ``param_dtype`` for the parameters the policy casts (``cast="all"``: every one;
        ``"autocast"``: those only matrix products read, as autocast casts them), fp32 for the rest
        (:mod:`fxpar.dtype_policy`)."""
        policy = self.policy(policy)
        low = policy.param_bytes
        if policy.cast == "all" or low == 4:
            return {p.fqn: low for p in self.graph.params}
        readers: dict[str, set[OpClass]] = {}
        for n in self.graph.nodes:
            for fqn in n.param_fqns:
                readers.setdefault(fqn, set()).add(n.op_class)
        products = {OpClass.MATMUL, OpClass.MOE_EXPERTS, OpClass.VIEW}
        out = {}
        for p in self.graph.params:
            classes = set().union(*(readers.get(name, set()) for name in (p.fqn, *p.aliases)))
            cast = bool(classes - {OpClass.VIEW}) and classes <= products
            out[p.fqn] = low if cast else 4
        return out

    def overlaps_communication(self, ranks=None) -> bool:
        """Whether communication runs beside compute on these devices: a measured answer from the
        devices' calibration (``ProfileDB.overlap``) where there is one; otherwise GPUs do (NCCL's
        own stream) and CPU ranks do not (gloo's thread shares the core that computes;
        :mod:`fxpar.profiling.collectives`)."""
        devices = self.cluster.devices if ranks is None else [self.cluster.device(r) for r in ranks]
        answers = []
        for d in devices:
            db = self.profiles.get(d.type.name)
            measured = None if db is None else getattr(db, "overlap", None)
            answers.append(measured if measured is not None else d.type.vendor != "cpu")
        return all(answers)

    def gradient_allreduce_s(self, policy: DtypePolicy | None = None, ranks=None) -> float:
        """The gradient all-reduce as the runtime issues it, every bucket one call
        (:func:`fxpar.profiling.collectives.gradient_buckets`), one after another."""
        return sum(map(self.allreduce_pricer(ranks), collectives.gradient_buckets(self.gradient_wire_bytes(policy))))

    # ---- communication -------------------------------------------------------------------
    def _profile_of(self, ranks=None) -> tuple[ProfileDB | None, int]:
        """(The profile of these devices' one type, None where they mix types or it has none; how many.)"""
        devices = self.cluster.devices if ranks is None else [self.cluster.device(r) for r in ranks]
        types = {d.type.name for d in devices}
        return (self.profiles.get(types.pop()) if len(types) == 1 else None), len(devices)

    def measured_link(self, kind: str, ranks=None):
        """A measured link of ``kind`` when every device involved has one type with a profile."""
        db, count = self._profile_of(ranks)
        link = None if db is None else db.links.get(kind)
        # a link measured on another number of ranks says nothing of this group's (ranks=None: the cluster)
        return link if link is not None and link.world == count else None

    def runtime_overhead(self, name: str, ranks=None) -> float:
        """A calibrated runtime cost (``"sharded_call_s"``, ``"pipeline_op_s"``, ``"expert_call_s"``,
        ``"tensor_call_s"``) of these devices when they are of one calibrated type, else 0
        (:mod:`fxpar.calibrate.runtime_probe`)."""
        return float(getattr(self._profile_of(ranks)[0], name, None) or 0.0)

    def step_overhead_s(self) -> float:
        """fxpar's step loop's seconds per training step that nothing else prices (calibrated,
        ``ProfileDB.step_overhead_s``): the largest of the cluster's device types', since a step
        waits for its slowest rank; 0 where none is calibrated.  Every form adds it once per step."""
        types = {d.type.name for d in self.cluster.devices}
        return max((float(getattr(self.profiles.get(t), "step_overhead_s", None) or 0.0) for t in types), default=0.0)

    def measured_links(self, ranks=None) -> dict:
        """Every measured collective of these devices (kind -> LinkCost), as :meth:`measured_link`
        (measured on as many ranks as these devices)."""
        return {kind: link for kind in collectives.LINK_KINDS
                if (link := self.measured_link(kind, ranks)) is not None}

    def network(self) -> Network:
        """The cluster's links with the devices' calibrated collectives: what every form's
        communication is priced from (:mod:`fxpar.profiling.network`)."""
        return network_of(self.cluster, self.measured_links(), tp_call_s=self.runtime_overhead("tensor_call_s"))

    def allreduce_s(self, nbytes: float, ranks=None) -> float:
        """One all-reduce of ``nbytes`` over ``ranks`` (all by default): the calibrated one where
        there is one, else the α-β formula; at the cluster's measured ``link_derate``."""
        return self.allreduce_pricer(ranks)(nbytes)

    def allreduce_pricer(self, ranks=None):
        """``nbytes -> seconds`` as :meth:`allreduce_s`, the group's link looked up once."""
        link, slow = self.measured_link("all_reduce", ranks), self.cluster.link_derate
        world = self.cluster.world_size if ranks is None else len(ranks)
        if link is not None:
            link = link if slow == 1.0 else scaled_link(link, slow)
            return lambda nbytes: collectives.measured_time(link, "all_reduce", world, nbytes)
        shape = collectives.ring_shape(self.cluster, ranks)
        shape = shape if slow == 1.0 else scaled_shape(shape, slow)
        return lambda nbytes: collectives.allreduce_time(shape, nbytes)

    def allreduce_lower_bound_s(self, nbytes: float, ranks=None) -> float:
        return collectives.allreduce_lower_bound(collectives.ring_shape(self.cluster, ranks), nbytes)
