"""One training arm of ``python -m benchmarks.gpu_check``, run in a process of its own.

An arm builds its model on the host with the check's seed (every arm holds the same initial
weights, recorded as a checksum; :func:`build`), the same global batch (on the host, as a data
loader hands it over), and trains it either with the plain HF loop (``model.to(device)``, ``torch.autocast`` in
bf16, ``torch.optim.AdamW``, ``loss.backward()``) or through fxpar's public API under a one-rank
process group (``fxpar.auto(model, fxpar.Cluster.detect(), batch, seq_len=..., dtype=...,
optimizer="adamw", forms=[...])`` or ``plan=`` a hand-written ZeRO-2 / ZeRO-3 plan,
``fxpar.make_optimizer(pmodel, torch.optim.AdamW)``, ``pmodel.step(batch)``).

The first step's loss and gradients (before its optimizer step) are what the parent compares;
the gradients leave the arm as a fingerprint (:func:`fingerprint`).  Then ``warmup - 1`` more
untimed steps and ``steps`` timed ones, ``torch.cuda.synchronize()`` around each; the step time
is their median and the peak is ``torch.cuda.max_memory_allocated`` over them.  The arm's record
is written after each phase, so a killed arm still leaves what it measured."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import fxpar
from benchmarks.gpu_check_setup import BATCH_SEED, MODEL_SEED, PLANNED_FORM
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.planning import trace_spec
from fxpar.profiling import local_cache
from fxpar.runtime import init_distributed
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs

#: random projections per parameter in a gradient fingerprint
PROJECTIONS = 16


def fingerprint(named: Iterable[tuple[str, torch.nn.Parameter]],
                tied: list[list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Per parameter ``[numel, ‖g‖₂, <g, r_1>, …, <g, r_K>]`` (float64, on the host) with
    ``r_k ~ N(0, I)`` drawn from a generator seeded by the parameter's name on the gradient's
    device, so two arms on the same device draw the same ``r_k``.  Since ``E<d, r>² = ‖d‖²``, the
    projections of two runs' gradients estimate ``‖g − g_ref‖₂`` without storing either
    (:func:`benchmarks.gpu_check_report.gradient_gaps`).  A parameter without a gradient: an
    empty tensor.  A parameter of several names (``tied``) is keyed and seeded by the first of
    them: a parallel module may report it under another."""
    first = {name: group[0] for group in tied or [] for name in group}
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        name = first.get(name, name)
        if p.grad is None:
            out[name] = torch.empty(0, dtype=torch.float64)
            continue
        g = p.grad.detach().reshape(-1).to(torch.float64)
        gen = torch.Generator(device=g.device).manual_seed(zlib.crc32(name.encode()))
        proj = [torch.dot(g, torch.randn(g.numel(), generator=gen, device=g.device, dtype=torch.float64))
                for _ in range(PROJECTIONS)]
        out[name] = torch.stack([torch.tensor(float(g.numel()), dtype=torch.float64, device=g.device),
                                 g.norm()] + proj).cpu()
    return out


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter held under several (GPT-2's head and token embedding): a
    parallel module may report the gradient under either."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def checksum(model: torch.nn.Module) -> float:
    """Σ of the first and the last parameter (float64): equal in every arm built with one seed."""
    params = list(model.parameters())
    return float(sum(p.detach().double().sum() for p in (params[0], params[-1])))


def compile_blocks(model: torch.nn.Module) -> None:
    """Each repeated block's forward compiled on its own (inductor, whole graphs), as torchtitan's
    ``apply_compile`` and ``fxpar.auto(..., compile=True)`` do."""
    from fxpar.tracing.structure import block_paths

    for path in block_paths(model):
        block = model.get_submodule(path)
        block.forward = torch.compile(block.forward, fullgraph=True)


class PlainLoop:
    """The plain HF loop: the model on the device, autocast for bf16, AdamW, ``loss.backward()``;
    ``compiled``: its blocks compiled (:func:`compile_blocks`)."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: str,
                 device: torch.device, compiled: bool = False) -> None:
        self.model, self.batch, self.dtype, self.device = model.to(device), batch, dtype, device
        if compiled:
            compile_blocks(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters())

    def forward_backward(self) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in self.batch.items()}
        amp = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.dtype == "bf16"
               else contextlib.nullcontext())
        with amp:
            loss = self.model(**batch).loss
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.model.named_parameters()


class Fsdp2Loop(PlainLoop):
    """torch FSDP2 on the one rank: ``fully_shard`` on every block and the root, bf16 parameters
    and fp32 reductions for a bf16 arm (``MixedPrecisionPolicy``), under the same autocast as
    the plain loop; its gradients read as local tensors (the one shard is the whole)."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: str,
                 device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from fxpar.tracing.structure import block_paths

        init_distributed(timeout_s=120)
        mesh = init_device_mesh(device.type, (1,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16"
                  else MixedPrecisionPolicy())
        model = model.to(device)
        for path in block_paths(model):
            fully_shard(model.get_submodule(path), mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        super().__init__(model, batch, dtype, device)

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        for name, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.grad is not None and hasattr(p.grad, "to_local"):
                local.grad = p.grad.to_local()
            yield name, local


class FxparLoop:
    """A parallel module from ``fxpar.auto``: ``pmodel.step(batch)`` and fxpar's optimizer."""

    def __init__(self, pmodel: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
        self.pmodel, self.batch = pmodel, batch
        self.optimizer = fxpar.make_optimizer(pmodel, torch.optim.AdamW)

    def forward_backward(self) -> torch.Tensor:
        return self.pmodel.step(self.batch).detach()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """Under the original model's names (a pipeline stage renames its parameters)."""
        named = getattr(self.pmodel, "named_original_parameters", None)
        return named() if callable(named) else self.pmodel.module.named_parameters()


def build(spec: dict[str, Any]) -> tuple[ModelSpec, torch.nn.Module, dict[str, torch.Tensor], str]:
    """The arm's model on the host, its global batch (seeded, on the host) and where the weights
    came from.  The first arm of a model builds it with the check's seed (``build_model``: HF's
    ``from_config``, as a user does) and saves it in fp32 to ``spec["init_dir"]``; the later arms
    load those weights on the host (``from_pretrained``, as a user of a checkpoint does): the same
    initial weights in every arm, without drawing a billion random numbers again."""
    mspec = ModelSpec(name=spec["model"], hf_config=spec["config"])
    folder = Path(spec["init_dir"]) if spec.get("init_dir") else None
    if folder is not None and (folder / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        source = f"loaded from {folder.name}/ (saved by the first arm)"
    else:
        model = build_model(mspec, device="cpu", dtype="fp32", seed=MODEL_SEED)
        source = f"built with seed {MODEL_SEED}"
        if folder is not None:  # written aside, then renamed: a killed arm leaves no half folder
            aside = folder.with_name(folder.name + ".part")
            model.save_pretrained(aside)
            os.replace(aside, folder)
    batch = example_inputs(model, spec["batch"], spec["seq"], device="cpu", seed=BATCH_SEED)
    return mspec, model.train(), batch, source


def cluster_for(device: torch.device) -> fxpar.Cluster:
    """``Cluster.detect()`` of the one-rank group on a GPU; ``Cluster.emulated([1.0])`` on a CPU."""
    return fxpar.Cluster.detect() if device.type == "cuda" else fxpar.Cluster.emulated([1.0])


Batch = dict[str, torch.Tensor]


def fxpar_loop(spec: dict[str, Any], mspec: ModelSpec, model: torch.nn.Module, batch: Batch, record: dict[str, Any],
               device: torch.device) -> tuple[FxparLoop, tuple[fxpar.Plan, ModelSpec, fxpar.Cluster]]:
    """Plan and build the arm's parallel module; its plan and predictions go into ``record``."""
    init_distributed(timeout_s=120)
    cluster = cluster_for(device)
    family, dtype, seq = spec["family"], spec["dtype"], spec["seq"]
    options = dict(seq_len=seq, dtype=dtype, optimizer="adamw", compile=family.endswith("-compiled"))
    family = family.removesuffix("-compiled")
    start = time.perf_counter()
    if family in ("zero2", "zero3"):
        plan = sharded_plan(spec, mspec, model, batch, cluster, record)
        pmodel = fxpar.auto(model, cluster, batch, plan=plan, **options)
    else:
        if family == "pipeline-mask":   # a collator's unpadded batch (module docstring of gpu_check_setup)
            batch = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
        form = PLANNED_FORM[family]
        pmodel = fxpar.auto(model, cluster, batch, forms=[form], **options)
    record["auto_s"] = time.perf_counter() - start
    record["cluster"] = str(cluster)
    record["plan"] = plan_summary(pmodel.plan)
    Path(spec["tmp"], "plans").mkdir(parents=True, exist_ok=True)
    Path(spec["tmp"], "plans", spec["file"] + ".json").write_text(json.dumps(
        {"plan": json.loads(pmodel.plan.to_json()), "cluster": cluster.to_dict(), "config": spec["config"]}))
    return FxparLoop(pmodel, batch), (pmodel.plan, mspec, cluster)


def sharded_plan(spec: dict[str, Any], mspec: ModelSpec, model: torch.nn.Module, batch: Batch,
                 cluster: fxpar.Cluster, record: dict[str, Any]) -> fxpar.Plan:
    """ZeRO-2 / ZeRO-3 forced by a hand-written plan (``fxpar.forms.hand_plans``): the whole
    batch and all the state on the one rank.  With ``spec["probe_planner"]`` (the run's first
    sharded arm) the record also says what the planner itself offers for
    ``forms=["sharded_data_parallel"]`` on this cluster."""
    stage = {"zero2": 2, "zero3": 3}[spec["family"]]
    if spec.get("probe_planner"):
        workload = fxpar.Workload(global_batch=spec["batch"], seq_len=spec["seq"], dtype=spec["dtype"],
                                  optimizer="adamw")
        try:
            offered = fxpar.make_plan(model, cluster, batch, workload, forms=["sharded_data_parallel"])
            record["planner_offers"] = f"{offered.form}, ZeRO-{offered.stages[0].sharded.stage}"
        except fxpar.FxparError as exc:
            record["planner_offers"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    record["plan_source"] = f"hand plan: sharded_data_parallel_plan(shard_stage={stage})"
    return sharded_data_parallel_plan(cluster, batch_split=[spec["batch"]], state_split=[1], shard_stage=stage,
                                      model=mspec.display_name, seq_len=spec["seq"], dtype=spec["dtype"])


def plan_summary(plan: fxpar.Plan) -> dict[str, Any]:
    """The plan's kind, micro-batching and its own predictions (zero for a hand-written plan)."""
    rank = plan.ranks[0]
    return {"form": plan.form, "micro_batch_size": rank.micro_batch_size,
            "num_microbatches": rank.num_microbatches,
            "shard_stage": plan.stages[0].sharded.stage if plan.stages[0].sharded is not None else None,
            "pipeline_stages": len(plan.stages) if plan.form == "pipeline" else None,
            "predicted_step_s": plan.predicted_step_s or None,
            "predicted_memory_bytes": rank.predicted_memory_bytes or None,
            "cost_source": getattr(plan, "cost_source", None), "text": plan.table()}


def predictions(plan: fxpar.Plan, mspec: ModelSpec, cluster: fxpar.Cluster) -> dict[str, Any]:
    """``fxpar.predict`` of the arm's plan, traced from the model's config on the meta device and
    priced as the planner prices its own arms in this run: with this GPU's cached measured profile
    where the run has one (keyed trace, ``fxpar.planning.measured_graph``'s rule), else by the
    catalog roofline.  ``cost_source`` says which, so a hand plan's error is read beside the
    planner's on the same prices."""
    start = time.perf_counter()
    found = local_cache.lookup(cluster, plan.dtype)
    model: Any = mspec
    if found.profiles:
        model = trace_spec(mspec, fxpar.Workload(global_batch=plan.global_batch, seq_len=plan.seq_len,
                                                 dtype=plan.dtype, optimizer=plan.optimizer), op_keys=True)
    pred = fxpar.predict(plan, model, cluster, profiles=found.profiles)
    return {"step_s": pred.step_s, "memory_bytes": pred.max_peak_memory_bytes, "parts": pred.parts,
            "cost_source": found.description, "wall_s": time.perf_counter() - start}


def measure(loop: PlainLoop | FxparLoop, spec: dict[str, Any], record: dict[str, Any], save: Callable[[], None],
            device: torch.device) -> None:
    """The first step (loss, gradient fingerprint), the warm-up and the timed steps."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    loss = loop.forward_backward()
    sync()
    record["first_step_s"] = time.perf_counter() - start
    record["loss0"] = float(loss)
    fp_path = Path(spec["tmp"], "grads", spec["file"] + ".pt")
    fp_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fingerprint(loop.named_parameters(), record.get("tied")), fp_path)
    record["fingerprint"] = str(fp_path)
    loop.update()
    save()
    losses = [record["loss0"]]
    for _ in range(max(spec["warmup"] - 1, 0)):
        losses.append(float(loop.forward_backward()))
        loop.update()
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["steps"]):
        sync()
        start = time.perf_counter()
        loss = loop.forward_backward()
        loop.update()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    record.update(losses=losses, step_times_s=times, step_s=statistics.median(times) if times else None)
    if cuda:
        record.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved())
    save()


def train_arm(spec: dict[str, Any], record: dict[str, Any], save: Callable[[], None]) -> None:
    """One arm, plain or fxpar (module docstring); ``record`` filled and saved as it goes."""
    device = torch.device(spec["device"], 0) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    mspec, model, batch, source = build(spec)
    record.update(build_s=time.perf_counter() - start, init_source=source, init_checksum=checksum(model),
                  tied=tied_names(model), params=sum(p.numel() for p in model.parameters()), batch=spec["batch"],
                  seq=spec["seq"])
    save()
    predict_args = None
    loop: PlainLoop | FxparLoop
    if spec["family"] in ("plain", "plain-compiled"):
        loop = PlainLoop(model, batch, spec["dtype"], device, compiled=spec["family"] == "plain-compiled")
    elif spec["family"] == "fsdp2":
        loop = Fsdp2Loop(model, batch, spec["dtype"], device)
    else:
        loop, predict_args = fxpar_loop(spec, mspec, model, batch, record, device)
    save()
    measure(loop, spec, record, save, device)
    if predict_args is not None and not predict_args[0].predicted_step_s:  # a hand plan predicts nothing itself
        try:
            record["predict"] = predictions(*predict_args)
        except Exception as exc:  # noqa: BLE001 - recorded; the measurement stands
            record["predict"] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
        save()
