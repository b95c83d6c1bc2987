"""Rank workers for models that do not export (``tests/multirank/test_recorded.py``): fxpar records the
model by running it, plans, and the step equals one process on the same global batch."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

import fxpar
from benchmarks.zoo import BATCH, SEED, batch, build
from fxpar.solvers.pipeline import search_ranked
from fxpar.forms.pipeline.search_plans import to_plan
from fxpar.solvers.problems import build_problems
from fxpar.tracing import trace
from fxpar.workload import Workload
from tests.multirank.models_unseen import LoopMoEForCausalLM, loop_moe_batch
from tests.parity import step_record
from tests.workers import rank_gradient_pairs
from tests.multirank.workers_pptp import reference_slice


def recorded_parity(form: str, speeds: list[float], batch: int, seq: int) -> dict:
    """One fxpar step of :class:`LoopMoEForCausalLM` under ``form`` (planned from the recorded
    graph) vs one process: the loss and this rank's gradients (``tests/parity.step_record``)."""
    torch.manual_seed(0)
    model = LoopMoEForCausalLM()
    reference = copy.deepcopy(model)
    data = loop_moe_batch(batch, seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recording's warning: tests/multirank/test_recorded.py checks it
        # a plain nn.Module whose loss is the mean over label tokens: say so (HF models need not)
        pm = fxpar.auto(model, fxpar.Cluster.emulated(speeds), data, global_batch=batch, emulate=False,
                        forms=[form], loss_weighting="tokens")
    loss = pm.step(data)
    ref_loss = reference(**data)["loss"]
    ref_loss.backward()
    pairs = rank_gradient_pairs(pm, reference)
    return {"rank": dist.get_rank(), "form": pm.plan.form, "shares": list(pm.plan.batch_shares),
            "stage": type(getattr(pm, "module", pm)).__name__, "explain": list(pm.plan.explain),
            **step_record(loss, ref_loss, pairs, reference)}


def searched_tp_parity(model_type: str, overrides: dict | None = None) -> dict:
    """One step of ``model_type``'s tiny zoo model (``overrides``: of its config) under the best
    plan the pipeline search prices with a stage two ranks wide (for a model that does not
    export, a tensor-parallel stage of eager blocks from the recorded graph) vs one process: the
    stages' widths, the stage class and :func:`tests.parity.step_record`."""
    model = build(model_type, overrides=overrides)
    reference = copy.deepcopy(model)
    data = batch(model)
    cluster, workload = fxpar.Cluster.emulated([1.0, 1.0], one_node=True), Workload(global_batch=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recording's warning: tests/multirank/test_recorded.py checks it
        graph = trace(model, batch(model, 1))
    problems = build_problems(graph, cluster, workload, ("pipeline",))
    cfg = next(c for c in search_ranked(problems.of("pipeline"), max_width=2, keep=64)
               if any(st.width == 2 for st in c.stages))
    plan = to_plan(cfg, problems.of("pipeline"), cluster, graph.model_name, workload, 0.0)
    pm = fxpar.auto(model, cluster, data, plan=plan, emulate=False)
    torch.manual_seed(SEED)
    loss = pm.step(data)
    torch.manual_seed(SEED)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    full = dict(reference.named_parameters(remove_duplicate=False))
    pairs = ((f, q.grad, reference_slice(q, full[f].grad)) for f, q in pm.named_original_parameters())
    return {"rank": dist.get_rank(), "widths": [st.tensor_parallel for st in pm.plan.stages],
            "stage": type(getattr(pm, "module", pm)).__name__, **step_record(loss, ref_loss, pairs, reference)}
