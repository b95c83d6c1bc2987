"""``fxpar.predict(plan, model_or_graph, cluster)``: the simulator's public face.

For a *given* plan (solver-made, hand-made, or one that describes another framework's run: see
the plan's runtime-behaviour fields ``overlap_grad_allreduce`` and ``allow_tf32``) it returns
the predicted step time, the step's parts and each rank's peak device memory
(:class:`Prediction`).  The numbers are :func:`fxpar.sim.simulate`'s, recomputed from the plan,
the model's graph and the cluster, never read from the plan's stored predictions; a solver plan
therefore gets back its own ``predicted_step_s``.

The step's parts add up to the step (seconds, the slowest position's view):

    pipeline:  step = compute + tensor_parallel + bubble + allreduce + optimizer + gather
        compute          forward + backward of the busiest position, less its TP all-reduces
        tensor_parallel  that position's tensor-parallel all-reduces (all micro-batches)
        bubble           the schedule's makespan minus that position's busy time (pipeline
                         fill / drain and waits on hops; ``hop_s`` is one micro-batch's hops,
                         forward and the gradients back)
        allreduce        the gradient all-reduce after the last backward (exposed part)
        optimizer        the slowest position's update; gather: ZeRO-1's all-gather
    data parallel:  step = compute + allreduce + optimizer   (compute: the slowest rank)
    expert parallel: step = compute + alltoall + allreduce + optimizer
    sharded data parallel: step = compute + gather + optimizer   (gather: the all-gathers and
        reduce-scatters the compute does not hide, :mod:`fxpar.sim.sharded_sim`)
    every form: + runtime, fxpar's step loop's own seconds (calibrated,
        :meth:`fxpar.profiling.CostModel.step_overhead_s`; 0 uncalibrated)

Memory: ``peak_memory_bytes`` is what the program allocates (model state, activations in flight,
buffers); ``driver_memory_bytes`` adds, per device kind, what a driver-level reading
(``nvidia-smi``) shows beyond that: the CUDA context, communication buffers and the caching
allocator's reserve (the calibration's ``driver_memory_bytes``, 0 without one).

Measured speeds: a re-balanced data-parallel plan records ``measured_speeds`` ``v_r``, the
samples per second rank r's forward + backward ran at (:mod:`fxpar.solvers.rebalance`).  It is
priced by the same simulator with rank r's device at the relative speed

    σ_r = v_r · c_r(1)        c_r(1): the cost model's marginal forward + backward seconds per
                              sample on r's device kind at speed 1 (``SampleCost.total_s``)

so that the simulator's seconds per sample on rank r are ``c_r(1) / σ_r = 1 / v_r``, the
measured ones; per-micro-batch fixed costs scale by the same ``1/σ_r``; the all-reduce, the
optimizer (not divided by a speed) and memory are the cost model's (:func:`measured_cluster`).

``calibration``: per device kind, constants fitted for the framework a plan describes
(:data:`fxpar.cluster.catalog.FRAMEWORK_CALIBRATION`): ``compute_scale`` and
``segment_overhead_s`` change a pipeline plan's stage times (:class:`fxpar.sim.pipeline_cost.
PipelinePrices`), ``driver_memory_bytes`` the driver-level memory; ``receive_in_flight`` (not
fitted: what the framework does) says the framework holds pipeline receive buffers for the
in-flight micro-batches only (:func:`fxpar.sim.rank_memory.stage_peak_bytes`).  Without it the
prediction is :func:`fxpar.sim.simulate`'s, exactly.

Each parallel form's prediction is its ``predict`` phase (:mod:`fxpar.forms`), from the shared
parts below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from fxpar.cluster import Device
from fxpar.errors import ConfigError, PlanError
from fxpar.forms import form, part
from fxpar.plan import Plan
from fxpar.planning import trace_spec
from fxpar.profiling import CostModel
from fxpar.profiling.database import ProfileDB
from fxpar.renamed import keeps_old_names
from fxpar.sim.pipeline_cost import PipelinePrices, pipeline_prices
from fxpar.sim.pipeline_plan import layout_of, price_plan
from fxpar.sim.segments import tp_seconds
from fxpar.sim.timeline import SimResult
from fxpar.solvers.rebalance import UNPRICED
from fxpar.tracing import ModelGraph
from fxpar.workload import Workload


@keeps_old_names("fxpar.Prediction")
@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """A plan's predicted step, its parts and per-rank memory (module docstring)."""

    form: str
    step_s: float
    compute_s: float
    tensor_parallel_s: float
    bubble_s: float
    allreduce_s: float
    alltoall_s: float
    optimizer_s: float
    gather_s: float
    runtime_s: float                      # the step loop's own seconds (calibrated)
    hop_s: float                          # one micro-batch's hops along a pipeline, both ways (in bubble)
    busy_s: tuple[float, ...]             # per rank
    idle_s: tuple[float, ...]             # per rank
    peak_memory_bytes: tuple[int, ...]    # per rank, what the program allocates
    driver_memory_bytes: tuple[int, ...]  # per rank, + the kind's driver-level overhead
    #: per rank, its parameters and optimizer state (:attr:`fxpar.sim.SimResult.state_bytes`;
    #: empty where the form does not say)
    state_bytes: tuple[int, ...] = ()

    @property
    def parts(self) -> dict[str, float]:
        """The step's parts (they add up to ``step_s``)."""
        return {"compute": self.compute_s, "tensor_parallel": self.tensor_parallel_s,
                "bubble": self.bubble_s, "allreduce": self.allreduce_s, "alltoall": self.alltoall_s,
                "optimizer": self.optimizer_s, "gather": self.gather_s, "runtime": self.runtime_s}

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes, default=0)

    @property
    def max_driver_memory_bytes(self) -> int:
        return max(self.driver_memory_bytes, default=0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["parts"] = self.parts
        d["max_peak_memory_bytes"] = self.max_peak_memory_bytes
        d["max_driver_memory_bytes"] = self.max_driver_memory_bytes
        return d

    def table(self) -> str:
        lines = [f"predicted step {self.step_s:.4g} s ({self.form})"]
        lines += [f"  {name:<16}{value:10.4g} s  {100 * value / self.step_s if self.step_s else 0:5.1f}%"
                  for name, value in self.parts.items() if value > 0]
        if self.hop_s > 0:
            lines.append(f"  (hops per micro-batch {self.hop_s:.4g} s, inside the bubble)")
        lines.append(f"peak memory per rank: max {self.max_peak_memory_bytes / 2**30:.2f} GiB allocated, "
                     f"{self.max_driver_memory_bytes / 2**30:.2f} GiB as the driver reports it")
        return "\n".join(lines)


def _graph(plan: Plan, model_or_graph: Any) -> ModelGraph:
    if isinstance(model_or_graph, ModelGraph):
        return model_or_graph
    if model_or_graph is None:
        raise ConfigError("predict: model_or_graph is None; give the model (a module, a ModelSpec or "
                          "(module, example_inputs)) or its traced ModelGraph")
    workload = Workload(global_batch=plan.global_batch, seq_len=plan.seq_len, dtype=plan.dtype,
                        optimizer=plan.optimizer)
    return trace_spec(model_or_graph, workload)


@dataclass(frozen=True, slots=True)
class MeasuredCluster:
    """``base`` with rank r's device at the measured relative speed ``σ_r`` (module docstring);
    everything else (nodes, links, names) is ``base``'s."""

    base: Any
    devices: tuple[Device, ...]

    def device(self, rank: int) -> Device:
        self.base.device(rank)  # the range check and its error
        return self.devices[rank]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def measured_cluster(plan: Plan, cost: CostModel) -> MeasuredCluster:
    """``cost``'s cluster with ``σ_r = v_r · c_r(1)`` for each rank (module docstring)."""
    if plan.measured_speeds is None:
        raise ConfigError("measured_cluster: the plan records no measured speeds")
    base = cost.cluster
    devices = []
    for r, v in enumerate(plan.measured_speeds):
        d = base.device(r)
        devices.append(replace(d, speed=v * cost.sample_cost(replace(d, speed=1.0)).total_s))
    return MeasuredCluster(base, tuple(devices))


def cost_model(plan: Plan, graph: ModelGraph, cluster, profiles: Mapping[str, ProfileDB] | None = None) -> CostModel:
    """The cost model a plan is priced under (its precision, optimizer and TF32 choice, and the
    measured speeds of a re-balanced plan)."""
    cost = CostModel(graph, cluster, dtype=plan.dtype, optimizer=plan.optimizer,
                     allow_tf32=plan.allow_tf32, profiles=profiles)
    if plan.measured_speeds is None:
        return cost
    return CostModel(graph, measured_cluster(plan, cost), dtype=plan.dtype, optimizer=plan.optimizer,
                     allow_tf32=plan.allow_tf32, profiles=profiles)


def predict(plan: Plan, model_or_graph: Any, cluster, *, profiles: Mapping[str, ProfileDB] | None = None,
            calibration: Mapping[str, Mapping[str, float]] | None = None) -> Prediction:
    """Predict ``plan`` on ``cluster`` (module docstring).  ``model_or_graph``: a traced
    :class:`ModelGraph`, or a model (traced on the meta device).  ``calibration``: per device
    kind, a framework's calibrated constants (module docstring; None: fxpar's own)."""
    if plan.world_size != cluster.world_size:
        raise ConfigError(f"predict: the plan has {plan.world_size} ranks but cluster {cluster.name!r} has "
                          f"{cluster.world_size} devices")
    graph = _graph(plan, model_or_graph)
    return part(plan.form, "predict").predict(plan, cost_model(plan, graph, cluster, profiles),
                                                  dict(calibration or {}))


def calibrated_pipeline_prices(cost: CostModel, calibration: Mapping[str, Mapping[str, Any]]) -> PipelinePrices:
    """The pipeline prices of ``cost`` with a framework's per-kind ``compute_scale``,
    ``segment_overhead_s`` and ``receive_in_flight`` (module docstring)."""
    kinds = {g.key: g.type.name for g in cost.cluster.groups()}

    def per_kind(name: str, kind: type) -> dict[str, Any]:
        return {k: kind(calibration[t][name]) for k, t in kinds.items() if name in calibration.get(t, {})}

    return pipeline_prices(cost, compute_scale=per_kind("compute_scale", float),
                           segment_overhead_s=per_kind("segment_overhead_s", float),
                           receive_in_flight=per_kind("receive_in_flight", bool))


def common_fields(plan: Plan, sim: SimResult, cluster: Any, calibration: Mapping[str, Mapping[str, Any]],
                  runtime_s: float = 0.0) -> dict[str, Any]:
    """The fields every form's :class:`Prediction` shares: the step, per-rank busy, idle and
    memory, the driver-level memory (the calibration's ``driver_memory_bytes`` added) and the step
    loop's own seconds ``runtime_s`` (inside ``sim.step_s``)."""
    driver = tuple(int(m + float(calibration.get(cluster.device(r).type.name, {}).get("driver_memory_bytes", 0)))
                   for r, m in enumerate(sim.peak_memory_bytes))
    return dict(form=plan.form, step_s=sim.step_s, busy_s=sim.busy_s, idle_s=sim.idle_s,
                peak_memory_bytes=sim.peak_memory_bytes, driver_memory_bytes=driver, runtime_s=runtime_s,
                state_bytes=sim.state_bytes)


def flat_prediction(plan: Plan, sim: SimResult, cluster: Any, calibration: Mapping[str, Mapping[str, Any]], *,
                    allreduce_s: float = 0.0, alltoall_s: float = 0.0, gather_s: float = 0.0,
                    runtime_s: float = 0.0) -> Prediction:
    """A step of one phase after another (no pipeline): compute, the exchanges given, the step
    loop's own seconds and the optimizer as what is left of the step."""
    return Prediction(compute_s=sim.compute_s, tensor_parallel_s=0.0, bubble_s=0.0, allreduce_s=allreduce_s,
                      alltoall_s=alltoall_s, optimizer_s=max(sim.step_s - sim.compute_s - sim.comm_s - runtime_s, 0.0),
                      gather_s=gather_s, hop_s=0.0, **common_fields(plan, sim, cluster, calibration, runtime_s))


def pipeline_parts(plan: Plan, prices: PipelinePrices, cluster: Any, common: dict[str, Any]) -> Prediction:
    """A pipeline plan's parts, the slowest pipeline replica's busiest position's view (module
    docstring)."""
    run, _ = price_plan(plan, prices, cluster)
    layout, _ = layout_of(plan, prices, cluster)
    # the slowest pipeline replica's view (pipelines may differ in device kinds and batch)
    q = max(range(len(run.replicas)), key=lambda p: (max(run.replicas[p].busy_s), -p))
    (kinds, b), m, t = layout.replica(q), layout.num_microbatches, prices.table
    tp = [0.0] * len(run.busy_s)
    for st, kind in zip(layout.stages, kinds):
        fwd, bwd = tp_seconds(t, prices.network, kind, st.width, b)
        tp[st.position] += float((fwd + bwd)[st.start:st.end].sum()) * m
    busy_s = run.replicas[q].busy_s
    busiest = max(range(len(busy_s)), key=lambda d: busy_s[d])
    busy = busy_s[busiest]
    return Prediction(compute_s=busy - tp[busiest], tensor_parallel_s=tp[busiest],
                      bubble_s=max(run.makespan_s - busy, 0.0), allreduce_s=run.exposed_allreduce_s,
                      alltoall_s=0.0, optimizer_s=run.optimizer_s, gather_s=run.gather_s,
                      hop_s=float(sum(run.hop_s) + sum(run.back_hop_s)), **common)


def priced_plan(plan: Plan, graph: Any, cluster: Any, profiles: Mapping[str, ProfileDB] | None = None) -> Plan:
    """``plan`` with every stored prediction from ``p = fxpar.predict(plan, graph, cluster)``:
    ``predicted_step_s = p.step_s``, compute ``p.compute_s``, communication ``p.allreduce_s``
    (the all-reduce's choice too), per rank busy ``p.busy_s[r]`` and memory
    ``p.peak_memory_bytes[r]`` (data-parallel plans)."""
    if not form(plan.form).rebalances:
        raise PlanError(f"priced: re-pricing is for plans whose shares re-balance (data_parallel), "
                        f"not {plan.form!r}")
    p = predict(plan, graph, cluster, profiles=profiles)
    ranks = tuple(replace(rp, predicted_busy_s=p.busy_s[r], predicted_memory_bytes=p.peak_memory_bytes[r])
                  for r, rp in enumerate(plan.ranks))
    collectives = tuple(replace(c, predicted_s=p.allreduce_s) if c.method == "all-reduce" else c
                        for c in plan.collectives)
    explain = tuple(line.split(UNPRICED)[0] for line in plan.explain)
    return replace(plan, ranks=ranks, collectives=collectives, predicted_step_s=p.step_s,
                   predicted_compute_s=p.compute_s, predicted_comm_s=p.allreduce_s, explain=explain)


@dataclass(frozen=True)
class Pricing:
    """What a plan was priced with: the traced graph, the cluster and any measured profiles.
    ``fxpar.auto`` leaves it on rank 0's module (``pmodel.pricing``) so that a plan re-balanced
    while training is priced the same way (:func:`priced_plan`)."""

    graph: ModelGraph
    cluster: Any
    profiles: Mapping[str, ProfileDB] | None = None

