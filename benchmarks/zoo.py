"""Zoo coverage: how much of transformers' causal-LM zoo fxpar traces, plans and runs in parallel.

``python -m benchmarks.zoo [--types a,b,...] [--columns dp,pp,tp] [--json OUT] [--no-parity] [--timeout S]``

Walks every model type of the installed transformers' causal-LM mapping
(``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a public,
documented module-level name, no underscore) and for each:

1. builds a **tiny config** from the type's defaults (:func:`tiny_config`, rule below) and
   trains it one step in plain PyTorch (batch 2 × 16 tokens, loss and backward on the CPU);
   a type that cannot is **skipped** (reported with the reason, not counted);
2. ``trace``: :func:`fxpar.tracing.trace` on one sample;
3. ``plan``: :func:`fxpar.solvers.plan` for 2 emulated ranks of speeds 1.0 / 0.5;
4. ``dp``: data-parallel parity on 2 ranks (uneven shares from the plan's LP, forced to data
   parallelism) — loss and every gradient vs one process on the same global batch;
5. ``pp``: 2-stage pipeline parity (one block per stage, 2 micro-batches, hand plan);
6. ``tp``: uneven tensor-parallel parity (key/value groups 3:1 — of 4, or in proportion for
   more — when the type has at least 4, else 1:1, not uneven, noted), loss and every gathered gradient vs one process.  The projections are
   read from the traced graph (:mod:`fxpar.tracing.tensor_parallel.analysis`); a block it refuses (q/k norms
   over the whole projection, a fused single-K/V-head projection, no attention at all) fails
   with the block and the reason recorded.

``--columns tp`` runs only the tensor-parallel column (trace and plan still run).  ``--update
OLD.json`` measures ``--types`` (default all) for ``--columns`` again and keeps OLD's other cells
(:func:`merged`); the JSON's ``runs`` lists every run a table merges, with its date and columns.

Parity: loss within 1e-4 and every gradient within 1e-4 absolute (fp32, one step, batch 4 ×
16; the pipeline's batch has no ignored labels, so its equal micro-batch weighting is exact).
Every parallel step and its reference start from the same random seed: a router that samples
while training (PhiMoE's sparsemixer, whose draws pick its backward's estimator) then draws the
same numbers on every rank of a tensor-parallel group, and a data-parallel or pipeline run no
longer depends on what the pool's ranks ran before (a rank's rows still draw other numbers than
one process's whole batch: exact where the draws do not change the result).
Multi-rank parts run on one :class:`fxpar.runtime.WorkerPool` of 2 gloo ranks, with a
per-type timeout (``--timeout``; a timeout kills the pool, the next type gets a fresh one).

The shrinking rule and the architecture kinds live in :mod:`benchmarks.zoo_tiny`.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from benchmarks.common import finish
from benchmarks.zoo_tiny import architecture, causal_lm_types, tiny_config
from fxpar.forms.hand_plans import block_paths, pipeline_plan, tensor_parallel_plan
from fxpar.codegen.common.module import RankModule
from fxpar.codegen.tensor.families import head_layout, split_sizes
from fxpar.runtime import WorkerPool
from fxpar.solvers import plan as solve_plan
from fxpar.tracing import trace
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import Workload
from tests.parity import gradient_gaps

BATCH, SEQ = 4, 16
SEED = 1234
TOL = 1e-4
COLUMNS = ("trace", "plan", "dp", "pp", "tp")

# ---- plain PyTorch: can the tiny model train one step at all? ------------------------------------
def build(model_type: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """The tiny model on the CPU (fxpar's builder: SDPA, or the class's eager attention);
    ``overrides`` replace fields of the tiny config."""

    config = dict(tiny_config(model_type), **(overrides or {}))
    return build_model(ModelSpec(hf_config=config), device="cpu", seed=seed).train()


def batch(model: torch.nn.Module, rows: int = BATCH, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids and labels (a composite model's from its text sub-config's vocabulary:
    :func:`fxpar.tracing.hf.example_inputs`)."""
    return example_inputs(model, rows, SEQ, seed=seed)


def trains_one_step(model_type: str) -> str | None:
    """None when the tiny model trains one step in plain PyTorch, else why not."""
    try:
        model = build(model_type)
        data = batch(model, 2)
        loss = model(**data, use_cache=False).loss
        if loss is None or not torch.isfinite(loss):
            return f"loss is {loss}"
        loss.backward()
        if not any(p.grad is not None for p in model.parameters()):
            return "no parameter receives a gradient"
    except Exception as exc:  # noqa: BLE001 - any failure is the reason it is skipped
        return _reason(exc)
    return None


def _reason(exc: BaseException | str) -> str:
    text = str(exc) if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if isinstance(exc, str):  # a WorkerError: the rank's own exception is the last line of its traceback
        tail = [ln for ln in lines if not ln.startswith(("File ", "^", "~", "Traceback", "rank"))]
        first = next((ln for ln in lines if "Error" in ln.split(":")[0]), lines[0] if lines else "")
        last = tail[-1] if tail else first
        text = last if "Error" in last.split(":")[0] else first
    else:
        text = lines[0] if lines else type(exc).__name__
    return text[:300]


# ---- worker functions (run on every rank of the pool) ---------------------------------------------
def _grad_diff(named_grads, reference: torch.nn.Module) -> tuple[float, int]:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    worst, n = 0.0, 0
    for name, g in named_grads:
        rg = ref[name].grad
        if g is None and rg is None:
            continue
        g = torch.zeros_like(ref[name]) if g is None else g
        rg = torch.zeros_like(g) if rg is None else rg
        worst = max(worst, (g.float() - rg.float()).abs().max().item())
        n += 1
    return worst, n


def _parity(loss, ref_loss, named_grads, reference: torch.nn.Module) -> dict[str, Any]:
    """What the parity rules of ``tests/parity.py`` need (the zoo's own verdict stays
    :data:`TOL`): both losses and the gradient gaps (``grads``: per tensor ‖g − g_ref‖, ‖g_ref‖
    and size, with the whole reference model's gradient norm)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    pairs = [(name, None if g is None else g.float(), None if ref[name].grad is None else ref[name].grad.float())
             for name, g in named_grads]
    return {"loss": float(loss), "ref_loss": float(ref_loss.detach()), "grads": gradient_gaps(pairs, reference)}


def dp_worker(model_type: str) -> dict:

    model = build(model_type)
    reference = copy.deepcopy(model)
    data = batch(model)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    graph = trace(model, {k: v[:1] for k, v in data.items()})
    plan = solve_plan(graph, cluster, Workload(global_batch=BATCH), forms=("data_parallel",))
    pm = fxpar.auto(model, cluster, data, global_batch=BATCH, emulate=False, plan=plan)
    torch.manual_seed(SEED)  # the same random draws as the reference (PhiMoE's router samples in training)
    loss = pm.step(data)
    torch.manual_seed(SEED)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    worst, n = _grad_diff(((k, p.grad) for k, p in pm.module.named_parameters()), reference)
    return {"rank": dist.get_rank(), "loss_diff": abs(float(loss) - float(ref_loss.detach())), "grad_diff": worst, "n": n,
            **_parity(loss, ref_loss, ((k, p.grad) for k, p in pm.module.named_parameters()), reference)}


def _first_stage_blocks(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> int:
    """Blocks of the first of 2 stages: up to the first half of the blocks the forward *runs*
    (the traced graph's), so a tower this batch never enters (a vision encoder without images)
    cannot leave a stage without work."""
    blocks = block_paths(model)
    ran = [layer.path for layer in trace(model, {k: v[:1] for k, v in data.items()}).layers
           if any(True for _ in model.get_submodule(layer.path).parameters())]   # not a list of rotary embeddings
    if len(ran) < 2 or any(p not in blocks for p in ran):
        return len(blocks) // 2
    return blocks.index(ran[len(ran) // 2 - 1]) + 1


def pp_worker(model_type: str) -> dict:

    model = build(model_type)
    reference = copy.deepcopy(model)
    data = batch(model)
    first = _first_stage_blocks(model, data)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=BATCH,
                         blocks_per_stage=[first, len(block_paths(model)) - first], num_microbatches=2)
    pm = RankModule(model, plan, dist.get_rank(), example_inputs=data, emulate=False)
    torch.manual_seed(SEED)
    loss = pm.step(data)
    torch.manual_seed(SEED)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    worst, n = _grad_diff(((k, p.grad) for k, p in pm.named_original_parameters()), reference)
    return {"rank": dist.get_rank(), "loss_diff": abs(float(loss) - float(ref_loss.detach())), "grad_diff": worst, "n": n,
            **_parity(loss, ref_loss, ((k, p.grad) for k, p in pm.named_original_parameters()), reference)}


def tp_worker(model_type: str, overrides: dict[str, Any] | None = None) -> dict:

    model = build(model_type, overrides=overrides)
    reference = copy.deepcopy(model)
    data = batch(model)
    kv = head_layout(model)[0]  # key/value groups as the traced graph shows them (config if none)
    shares = split_sizes(kv, [3, 1]) if kv >= 4 else [1, 1]
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=shares)
    pm = fxpar.auto(model, cluster, plan=plan, emulate=False)
    torch.manual_seed(SEED)  # the same random draws as the reference (PhiMoE's router samples in training)
    loss = pm.step(data)
    torch.manual_seed(SEED)
    ref_loss = reference(**data, use_cache=False).loss
    ref_loss.backward()
    grads = pm.gather_gradients(0)
    out = {"rank": dist.get_rank(), "loss_diff": abs(float(loss) - float(ref_loss.detach())), "grad_diff": 0.0, "n": 0,
           "shares": shares, **_parity(loss, ref_loss, (), reference)}
    if grads is not None:
        out["grad_diff"], out["n"] = _grad_diff(grads.items(), reference)
        out.update(_parity(loss, ref_loss, grads.items(), reference))
    return out


WORKERS = {"dp": dp_worker, "pp": pp_worker, "tp": tp_worker}


def traced_dp_worker(model_type: str) -> dict:
    """Trace, plan (rank 0: the full planner for 2 ranks of speeds 1.0 / 0.5) and data-parallel
    parity in one call (``tests/multirank/test_zoo.py``: one pool round trip per type)."""
    out: dict[str, Any] = {"rank": dist.get_rank()}
    if dist.get_rank() == 0:
        model = build(model_type)
        graph = trace(model, batch(model, 1))
        out["blocks"] = len(graph.layers)
        out["form"] = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=BATCH)).form
        out["attn_implementation"] = graph.attn_implementation
    dist.barrier()
    out.update(dp_worker(model_type))
    return out


# ---- the walk ---------------------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextmanager
def _deadline(seconds: float):
    """Raise :class:`_Timeout` in this (main) thread after ``seconds``."""
    def fire(*_: Any) -> None:
        raise _Timeout(f"timed out after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_local(model_type: str, timeout: float) -> dict[str, Any]:
    """Skip check, trace and plan in this process: ``{"skipped": reason}`` or the columns."""

    row: dict[str, Any] = {"type": model_type}
    start = time.perf_counter()
    try:
        with _deadline(timeout):
            why = trains_one_step(model_type)
            if why is not None:
                return {**row, "skipped": why}
            model = build(model_type)
            row["architecture"] = architecture(model_type, model)
            row["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
            row["params"] = sum(p.numel() for p in model.parameters())
            try:
                graph = trace(model, batch(model, 1))
                row["trace"] = {"ok": True, "blocks": len(graph.layers), "ops": len(graph.nodes),
                                "recorded": bool(graph.recorded)}
            except Exception as exc:  # noqa: BLE001
                row["trace"] = {"ok": False, "reason": _reason(exc)}
                return row
            try:
                plan = solve_plan(graph, fxpar.Cluster.emulated([1.0, 0.5]), Workload(global_batch=BATCH))
                row["plan"] = {"ok": True, "form": plan.form}
            except Exception as exc:  # noqa: BLE001
                row["plan"] = {"ok": False, "reason": _reason(exc)}
    except _Timeout as exc:
        row.setdefault("trace", {"ok": False, "reason": str(exc)})
        row.setdefault("plan", {"ok": False, "reason": str(exc)})
    row["local_s"] = round(time.perf_counter() - start, 2)
    return row


def check_parallel(pool_box: list, model_type: str, kind: str, timeout: float) -> dict[str, Any]:
    """One parity column on the pool's 2 ranks (the pool is replaced if a type hangs it)."""

    if pool_box[0] is None or not pool_box[0].alive:
        if pool_box[0] is not None:
            pool_box[0].close()
        pool_box[0] = WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"})
    start = time.perf_counter()
    try:
        results = pool_box[0].run(WORKERS[kind], model_type, timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if "no answer within" in msg or "died" in msg:
            pool_box[0].close()
            pool_box[0] = None
        return {"ok": False, "reason": _reason(msg), "s": round(time.perf_counter() - start, 2)}
    loss = max(r["loss_diff"] for r in results)
    grad = max(r["grad_diff"] for r in results)
    n = sum(r["n"] for r in results)
    ok = loss <= TOL and grad <= TOL and n > 0
    out = {"ok": ok, "loss_diff": loss, "grad_diff": grad, "grads": n, "s": round(time.perf_counter() - start, 2)}
    if "shares" in results[0]:
        out["shares"] = results[0]["shares"]
    if not ok:
        out["reason"] = (f"mismatch: loss diff {loss:.2e}, max grad diff {grad:.2e} (tolerance {TOL:g})"
                         if n else "no gradients compared")
    return out


def walk(types: list[str], *, parity: tuple[str, ...], timeout: float, budget_s: float | None = None,
         log=lambda line: print(line, flush=True)) -> list[dict[str, Any]]:
    """Every type's row; parity columns stop being tried once ``budget_s`` is spent."""
    pool_box: list = [None]
    rows = []
    start = time.perf_counter()
    try:
        for t in types:
            row = check_local(t, timeout)
            over = budget_s is not None and time.perf_counter() - start > budget_s
            if "skipped" not in row and row.get("trace", {}).get("ok"):
                for kind in parity:
                    row[kind] = ({"ok": None, "reason": "not run: time budget spent"} if over
                                 else check_parallel(pool_box, t, kind, timeout))
            rows.append(row)
            log(_line(row))
    finally:
        if pool_box[0] is not None:
            pool_box[0].close()
    return rows


def _mark(cell: dict | None) -> str:
    if not cell:
        return "-"
    return {True: "ok", False: "FAIL", None: "n/a"}[cell.get("ok")]


def _line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"{row['type']:<28} skipped: {row['skipped'][:120]}"
    cells = " ".join(f"{c}={_mark(row.get(c))}" for c in COLUMNS)
    why = next((f"{c}: {row[c]['reason'][:120]}" for c in COLUMNS if row.get(c) and row[c].get("ok") is False), "")
    return f"{row['type']:<28} {cells} {why}"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tried = [r for r in rows if "skipped" not in r]
    cover = {}
    for c in COLUMNS:
        run = [r for r in tried if r.get(c) and r[c].get("ok") is not None]
        cover[c] = {"ok": sum(1 for r in run if r[c]["ok"]), "run": len(run), "of": len(tried)}
    decoders = [r for r in tried if r.get("architecture") == "decoder-only"]
    run = [r for r in decoders if r.get("tp") and r["tp"].get("ok") is not None]
    cover["tp_decoder_only"] = {"ok": sum(1 for r in run if r["tp"]["ok"]), "run": len(run), "of": len(decoders)}
    kinds: dict[str, int] = {}
    for r in tried:
        kinds[r.get("architecture", "unknown")] = kinds.get(r.get("architecture", "unknown"), 0) + 1
    reasons: dict[str, dict[str, int]] = {}
    for c in COLUMNS:
        for r in tried:
            if r.get(c) and r[c].get("ok") is False:
                key = _reason_key(r[c]["reason"])
                reasons.setdefault(c, {})[key] = reasons.setdefault(c, {}).get(key, 0) + 1
    top = {c: sorted(v.items(), key=lambda kv: -kv[1])[:8] for c, v in reasons.items()}
    recorded = sorted(r["type"] for r in tried if (r.get("trace") or {}).get("recorded"))
    return {"types": len(rows), "skipped": len(rows) - len(tried), "tried": len(tried), "coverage": cover,
            "recorded": recorded,
            "architectures": kinds, "top_failures": top}


def _reason_key(reason: str) -> str:
    """A failure reason without its type-specific details (for grouping)."""
    head = reason.split(" (")[0]
    return head[:110]


def merged(previous: list[dict[str, Any]], rows: list[dict[str, Any]], parity: tuple[str, ...]) -> list[dict[str, Any]]:
    """``previous`` rows with the types of ``rows`` measured again: their skip check, trace, plan
    and the ``parity`` columns replaced, the other columns kept (pure; ``--update``)."""
    fresh = {r["type"]: r for r in rows}
    out = []
    for old in previous:
        new = fresh.pop(old["type"], None)
        if new is None:
            out.append(old)
        elif "skipped" in new:
            out.append(new)
        else:
            kept = {c: old[c] for c in WORKERS if c in old and c not in parity and "skipped" not in old}
            out.append({**kept, **new})
    return out + list(fresh.values())


def _table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    table_rows = []
    for r in rows:
        if "skipped" in r:
            table_rows.append([r["type"], "-", *(["skip"] * len(COLUMNS)), r["skipped"][:90]])
            continue
        why = next((f"{c}: {r[c]['reason']}" for c in COLUMNS if r.get(c) and r[c].get("ok") is False), "")
        table_rows.append([r["type"], r.get("architecture", "-"), *(_mark(r.get(c)) for c in COLUMNS), why[:90]])
    return table_rows


def _caption(version: str, summ: dict[str, Any], seconds: float) -> str:
    cov = ", ".join(f"{c} {v['ok']}/{v['of']}" for c, v in summ["coverage"].items() if c in COLUMNS)
    tp_dec = summ["coverage"]["tp_decoder_only"]
    recorded = summ.get("recorded", [])
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(summ["architectures"].items(), key=lambda kv: -kv[1]))
    return (f"transformers {version}: {summ['types']} causal-LM types, {summ['skipped']} "
            f"skipped (tiny model does not train in plain PyTorch), coverage of the {summ['tried']} others: "
            f"{cov}; tp over the {tp_dec['of']} decoder-only types: {tp_dec['ok']}/{tp_dec['of']}; "
            f"{len(recorded)} recorded, not exported ({', '.join(recorded) or 'none'}) "
            f"(architectures: {kinds}) ({seconds:.0f} s)")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", help="comma-separated model types (default: the whole causal-LM mapping)")
    ap.add_argument("--json", type=Path, help="folder for the JSON result (default: benchmarks/results)")
    ap.add_argument("--no-parity", action="store_true", help="trace and plan only")
    ap.add_argument("--columns", default="dp,pp,tp",
                    help="comma-separated parity columns to run (default: dp,pp,tp; e.g. tp)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per type and column")
    ap.add_argument("--budget", type=float, default=1500.0,
                    help="seconds after which parity columns are no longer run (trace/plan go on)")
    ap.add_argument("--update", type=Path,
                    help="a previous zoo JSON: measure --types (default all) for --columns again and keep its "
                         "other cells (the result lists every run it merges)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import json

    import transformers

    args = _arguments(argv)
    if args.update is not None and not args.update.is_file():
        sys.exit(f"--update {args.update}: no such file (a zoo JSON written by an earlier run)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    known = causal_lm_types()
    types = [t.strip() for t in args.types.split(",")] if args.types else known
    unknown = [t for t in types if t not in known]
    if unknown:
        sys.exit(f"--types: {unknown} not in transformers {transformers.__version__}'s causal-LM mapping")
    start = time.perf_counter()
    parity = tuple(c.strip() for c in args.columns.split(",") if c.strip())
    if set(parity) - set(WORKERS):
        sys.exit(f"--columns: {sorted(set(parity) - set(WORKERS))} not among {sorted(WORKERS)}")
    parity = () if args.no_parity else parity
    rows = walk(types, parity=parity, timeout=args.timeout, budget_s=args.budget)
    run = {"date": time.strftime("%Y-%m-%d %H:%M"), "types": len(types), "columns": list(parity)}
    runs, quick = [run], bool(args.types) or args.no_parity
    if args.update is not None:
        previous = json.loads(args.update.read_text())
        rows = merged(previous["types"], rows, parity)
        runs, quick = previous.get("runs", [{"file": args.update.name}]) + [run], previous.get("quick", quick)
    summ = summary(rows)
    head = ["type", "architecture", *COLUMNS, "first failure / skip reason"]
    return finish("zoo", title="HF causal-LM zoo coverage", caption=_caption(transformers.__version__, summ,
                  time.perf_counter() - start), head=head, rows=_table_rows(rows), quick=quick, out=args.json,
                  transformers=transformers.__version__, summary=summ, types=rows, runs=runs,
                  wall_s=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
