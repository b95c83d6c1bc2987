"""The toy form's end to end (``tests/toy_form``, a plug-in form): functions that run inside
spawned gloo ranks whose environment names it (``FXPAR_FORMS=tests.toy_form``), so their
registry holds it while this test process's does not."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar.adapt import Adapt, DetectorSettings
from fxpar.checkpoint import load_checkpoint, save_checkpoint
from fxpar.cli import main as cli_main
from fxpar.errors import PlanError
from fxpar.forms import NAMES, SEARCHED, form, part
from fxpar.plan import Plan
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.workload import Workload
from tests.parity import snapshot, step_record, trajectory_gaps
from tests.workers import global_batch, tiny_model

TOY = "replicated"
BATCH, SEQ = 8, 16
#: links slow enough that exchanging the gradients costs more than every rank training it all
SLOW_GBPS, FAST_GBPS = 1e-4, 10.0


def _cluster(gbps: float) -> fxpar.Cluster:
    return fxpar.Cluster.emulated([1.0, 0.5], inter_node_gbps=gbps)


def planning(out_dir: str) -> dict[str, Any]:
    """The registry, the planner's choice on fast and slow links, the plan's JSON round trip,
    table, price, prediction and lower bound, a wrong plan's error, and ``fxpar plan --emit``."""
    model = tiny_model("llama")
    data = global_batch(model, BATCH, SEQ)
    graph = trace(model, {k: v[:1] for k, v in data.items()})
    out: dict[str, Any] = {"names": list(NAMES), "searched": list(SEARCHED), "modules": form(TOY).modules}
    for name, gbps in (("fast", FAST_GBPS), ("slow", SLOW_GBPS)):
        cluster = _cluster(gbps)
        plan = solve_plan(graph, cluster, Workload(global_batch=BATCH, seq_len=SEQ))
        toy = solve_plan(graph, cluster, Workload(global_batch=BATCH, seq_len=SEQ), forms=(TOY,))
        out[name] = {"form": plan.form, "step_s": plan.predicted_step_s, "toy_step_s": toy.predicted_step_s,
                     "toy_bound_s": part(TOY, "bound").bound_s(*_bound_args(graph, cluster)),
                     "lower_bound_s": plan.lower_bound_s, "explain": list(plan.explain),
                     "round_trip": Plan.from_json(toy.to_json()) == toy, "table": toy.table(),
                     "predicted_s": fxpar.predict(toy, graph, cluster).step_s, "shares": list(toy.batch_shares)}
    bad = dataclasses.replace(toy.ranks[1], batch_share=BATCH // 2)
    try:
        dataclasses.replace(toy, ranks=(toy.ranks[0], bad))
        out["bad_plan"] = None
    except PlanError as exc:
        out["bad_plan"] = str(exc)
    cluster_file = Path(out_dir) / "slow.yaml"
    cluster_file.write_text(f"inter_node_gbps: {SLOW_GBPS}\nnodes:\n  - {{gpu: cpu, count: 1, speed: 1.0}}\n"
                            "  - {gpu: cpu, count: 1, speed: 0.5}\n")
    emitted = Path(out_dir) / "emit"
    out["cli"] = cli_main(["plan", "--cluster", str(cluster_file), "--model", "tests/fixtures/tiny_llama_config.json",
                           "--batch", str(BATCH), "--seq", str(SEQ), "--emit", str(emitted)])
    out["emitted"] = {p.name: json.loads(p.read_text()) for p in sorted(emitted.glob("*.json"))}
    return out


def _bound_args(graph, cluster) -> tuple[Any, int, Any]:
    """``(cost, batch, work)`` the planner's bound phase reads (:func:`fxpar.solvers.bounds.form_bounds_s`)."""
    from fxpar.profiling import CostModel
    from fxpar.solvers.bounds import _work

    cost = CostModel(graph, cluster)
    return cost, BATCH, _work(cost, BATCH, False)


def parity(steps: int = 2) -> dict[str, Any]:
    """``fxpar.auto`` picks the toy form on slow links; ``steps`` AdamW steps beside one process:
    the loss and every gradient per step, the weights' trajectory at the end."""
    model = tiny_model("llama")
    reference, initial = copy.deepcopy(model), snapshot(model)
    data = [global_batch(model, BATCH, SEQ, seed=1 + s) for s in range(steps)]
    pm = fxpar.auto(model, _cluster(SLOW_GBPS), data[0], global_batch=BATCH, emulate=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    out: dict[str, Any] = {"rank": dist.get_rank(), "form": pm.plan.form, "module": type(pm).__name__, "pass": type(pm.form).__name__,
                           "rows": list(pm.batch_rows()), "steps": []}
    names = dict(reference.named_parameters())
    for k, batch in enumerate(data):
        loss = pm.step(batch)
        ref_loss = reference(**batch, use_cache=False).loss
        ref_loss.backward()
        pairs = ((n, p.grad, names[n].grad) for n, p in pm.module.named_parameters())
        out["steps"].append(step_record(loss, ref_loss, pairs, reference, steps_before=k))
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    out["weights"] = trajectory_gaps((n, p, names[n], initial[n]) for n, p in pm.module.named_parameters())
    return out


def switches(checkpoint: str) -> dict[str, Any]:
    """Adapting switches data parallelism → the toy form → data parallelism → the toy form
    (``switch_to``, the path a decision takes: the state, AdamW's included, moved in memory),
    then the toy form's checkpoint is loaded by a fresh data-parallel module that trains on:
    the losses beside one process at every step, the weights' trajectory at the end."""
    model = tiny_model("llama")
    fresh, reference, initial = copy.deepcopy(model), copy.deepcopy(model), snapshot(model)
    plans = {}
    steps = 6
    data = [global_batch(model, BATCH, SEQ, seed=1 + s) for s in range(steps)]
    cluster = _cluster(FAST_GBPS)
    graph = trace(model, {k: v[:1] for k, v in data[0].items()})
    for name in ("data_parallel", TOY):
        plans[name] = solve_plan(graph, cluster, Workload(global_batch=BATCH, seq_len=SEQ), forms=(name,))
    never = Adapt(detector=DetectorSettings(warmup_steps=10**6), verbose=False)   # only switch_to switches
    pm = fxpar.auto(model, cluster, data[0], global_batch=BATCH, emulate=False, plan=plans["data_parallel"],
                    adapt=never)
    opt = pm.track(torch.optim.AdamW(pm.parameters(), lr=1e-3))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    order = {1: TOY, 2: "data_parallel", 3: TOY}
    out: dict[str, Any] = {"rank": dist.get_rank(), "losses": [], "kinds": []}
    for k in range(steps):
        if k in order:
            pm.switch_to(plans[order[k]])
        if k == 4:   # the toy form's checkpoint, loaded under data parallelism
            out["events"] = [e["kind"] for e in pm.events]
            save_checkpoint(pm, opt, checkpoint, step=k)
            pm = fxpar.auto(fresh, cluster, data[0], emulate=False, plan=plans["data_parallel"])
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            out["resumed_at"] = load_checkpoint(pm, opt, checkpoint).step
        loss = pm.step(data[k])
        ref_loss = reference(**data[k], use_cache=False).loss
        ref_loss.backward()
        out["losses"].append((float(loss), float(ref_loss)))
        out["kinds"].append(pm.plan.form)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    names = dict(reference.named_parameters())
    out["weights"] = trajectory_gaps((n, p, names[n], initial[n]) for n, p in pm.module.named_parameters())
    out["n_state"] = sum(len(s) for s in opt.state.values())
    return out
