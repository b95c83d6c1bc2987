"""The judgements and the table of ``python -m benchmarks.gpu_check``: each fxpar arm against the
plain HF loop of the same model, precision and batch (first-step loss, every parameter's gradient,
step time and peak memory), and the plan's predictions against what the arm measured.

Tolerances are multiples of the unit roundoff ``u`` of the precision the arms compute in (bf16:
``u = 2**-8``; fp32: ``u = 2**-24``), in the spirit of ``tests/parity.py`` (which holds fp32 CPU
runs to ``64·eps`` on the loss and ``1024·eps`` per gradient):

- bf16 (autocast: bf16 matmul operands, fp32 accumulation, fp32 master weights in both runs):
  the loss within ``2u = 2**-7`` relative, each gradient within ``8u = 2**-5``.  Two runs that
  round an operand differently differ there by ``u``; a product has two operands, and the
  differences of a few layers add up along the backward pass.  A dropped or doubled sample moves a
  gradient by about ``1/B`` of itself (``≥ 6%`` for ``B ≤ 16``), past the bound; a 1% error is
  left to the fp32 arms.
- fp32 (no TF32 in either run): the loss within ``2**9·u = 2**-15`` relative, each gradient within
  ``2**14·u = 2**-10``: the worst case of a sum of ``K`` terms reordered is ``2K·u``, and the
  longest sums here are over the batch's ``K ≤ 4096`` tokens (a 1% error is 10x the bound).

A gradient's gap is ``‖g − g_ref‖₂`` estimated from random projections
(:func:`benchmarks.gpu_check_arms.fingerprint`: 16 of them, about 18% standard error), held to
``rtol·(‖g_ref‖₂ + ‖G_ref‖₂·√(m/M))`` with ``tests/parity.py``'s floor: the share of the whole
model's gradient norm ``G_ref`` that its ``m`` of the model's ``M`` elements would carry (a
parameter whose own gradient cancels still carries the rounding noise of the terms summed into it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from benchmarks.common import table

UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp32": 2.0 ** -24}
LOSS_RTOL = {"bf16": 2 * UNIT_ROUNDOFF["bf16"], "fp32": 2 ** 9 * UNIT_ROUNDOFF["fp32"]}
GRAD_RTOL = {"bf16": 8 * UNIT_ROUNDOFF["bf16"], "fp32": 2 ** 14 * UNIT_ROUNDOFF["fp32"]}
GIB = 2.0 ** 30


def gradient_gaps(fp: dict[str, Any], ref: dict[str, Any], rtol: float) -> dict[str, Any]:
    """Per-parameter gaps of two fingerprints (``fp`` against the plain loop's ``ref``): the worst
    gap over its bound, where it is, and the whole gradient's relative gap."""
    names = [n for n in ref if n in fp]
    lacking = sorted(n for n in ref if n not in fp or (fp[n].numel() == 0) != (ref[n].numel() == 0))
    sizes = {n: float(ref[n][0]) for n in names if ref[n].numel()}
    total = math.sqrt(sum(float(ref[n][1]) ** 2 for n in sizes))
    elements = sum(sizes.values()) or 1.0
    worst, where, gap_sq = 0.0, None, 0.0
    for n in sizes:
        if fp[n].numel() == 0:
            continue
        diff = fp[n][2:] - ref[n][2:]
        gap = math.sqrt(float((diff * diff).mean()))
        bound = rtol * (float(ref[n][1]) + total * math.sqrt(sizes[n] / elements))
        ratio = gap / bound if bound > 0 else (0.0 if gap == 0 else math.inf)
        gap_sq += gap * gap
        if ratio > worst or where is None:
            worst, where = ratio, n
    return {"params": len(sizes), "lacking": lacking[:5], "n_lacking": len(lacking),
            "extra": sorted(n for n in fp if n not in ref)[:5], "worst_over_bound": worst, "worst_param": where,
            "rel_gap": math.sqrt(gap_sq) / total if total > 0 else None, "rtol": rtol,
            "ok": worst <= 1.0 and not lacking}


def compare(arm: dict[str, Any], plain: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """An fxpar arm against its plain loop, and its predictions against its measurements."""
    out: dict[str, Any] = {"loss_rtol": LOSS_RTOL[dtype]}
    if plain and "loss0" in plain and "loss0" in arm:
        gap = abs(arm["loss0"] - plain["loss0"]) / abs(plain["loss0"])
        out.update(loss_rel_gap=gap, loss_ok=gap <= LOSS_RTOL[dtype])
        if plain.get("init_checksum") is not None:
            out["same_init"] = arm.get("init_checksum") == plain["init_checksum"]
    if plain and arm.get("fingerprint") and plain.get("fingerprint"):
        out["grads"] = gradient_gaps(torch.load(arm["fingerprint"]), torch.load(plain["fingerprint"]),
                                     GRAD_RTOL[dtype])
    if plain and arm.get("step_s") and plain.get("step_s"):
        out["step_ratio"] = arm["step_s"] / plain["step_s"]
    if plain and arm.get("peak_allocated_bytes") and plain.get("peak_allocated_bytes"):
        out["memory_ratio"] = arm["peak_allocated_bytes"] / plain["peak_allocated_bytes"]
    step, memory = predicted(arm)
    if step and arm.get("step_s"):
        out["predicted_step_error"] = (step - arm["step_s"]) / arm["step_s"]
    if memory and arm.get("peak_allocated_bytes"):
        out["predicted_memory_error"] = (memory - arm["peak_allocated_bytes"]) / arm["peak_allocated_bytes"]
    checks = [out.get("loss_ok"), (out.get("grads") or {}).get("ok")]
    out["ok"] = None if None in checks else all(checks)
    return out


def predicted(arm: dict[str, Any]) -> tuple[float | None, float | None]:
    """The arm's predicted step and memory: the plan's own, else ``fxpar.predict``'s."""
    plan, pred = arm.get("plan") or {}, arm.get("predict") or {}
    return (plan.get("predicted_step_s") or pred.get("step_s"),
            plan.get("predicted_memory_bytes") or pred.get("memory_bytes"))


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _err(value: float | None, error: float | None, fmt: str) -> str:
    return "-" if value is None else f"{format(value, fmt)} ({'-' if error is None else f'{100 * error:+.0f}%'})"


def arm_row(name: str, arm: dict[str, Any], cmp: dict[str, Any]) -> list[str]:
    """One table row: what the arm measured, how it compares, what was predicted."""
    if arm.get("skipped"):
        return [name, "-", "skipped", "", "", "", "", "", "", "", "", "", ""]
    plan = arm.get("plan") or {}
    family = name.rsplit("/", 1)[-1]
    kind = plan.get("form") or plan.get("strategy") or (   # "strategy": runs before 2026-12-05
        {"plain": "plain HF loop", "plain-compiled": "plain HF loop", "fsdp2": "torch FSDP2"}.get(family, "-"))
    if family.endswith("-compiled"):
        kind += ", compiled"
    if plan.get("shard_stage"):
        kind = f"ZeRO-{plan['shard_stage']}"
    if plan.get("num_microbatches", 1) > 1:
        kind += f" x{plan['num_microbatches']} mb"
    step, memory = predicted(arm)
    peak = arm.get("peak_allocated_bytes")
    grads = cmp.get("grads") or {}
    verdict = {True: "ok", False: "FAIL", None: "-"}[cmp.get("ok")]
    if arm.get("error"):
        verdict = "ERROR"
    return [name, f"{arm.get('batch', '-')}x{arm.get('seq', '-')}", kind, _num(arm.get("step_s"), ".4f"),
            _num(cmp.get("step_ratio"), ".3f"), _num(None if peak is None else peak / GIB, ".2f"),
            _num(cmp.get("memory_ratio"), ".3f"), _err(step, cmp.get("predicted_step_error"), ".4f"),
            _err(None if memory is None else memory / GIB, cmp.get("predicted_memory_error"), ".2f"),
            _num(arm.get("loss0"), ".5f"), _num(_over(cmp.get("loss_rel_gap"), cmp.get("loss_rtol")), ".3f"),
            _num(grads.get("worst_over_bound"), ".3f"), verdict]


def _over(gap: float | None, tol: float | None) -> float | None:
    return None if gap is None or not tol else gap / tol


HEAD = ("arm", "batch", "plan", "step s", "x plain", "peak GiB", "x plain", "pred s (err)", "pred GiB (err)",
        "loss0", "loss gap/tol", "grad gap/tol", "ok")


def render(result: dict[str, Any]) -> str:
    """The table of arms, then one line per other part and each arm's error."""
    rows = [arm_row(name, arm, result["comparisons"].get(name, {})) for name, arm in result["arms"].items()]
    lines = [table(HEAD, rows)] if rows else []
    lines += [f"{name}: {arm['error']}" for name, arm in result["arms"].items() if arm.get("error")]
    lines += part_lines(result)
    return "\n".join(lines)


def part_lines(result: dict[str, Any]) -> list[str]:
    """The process group, the checkpoint load, the profile, the test suite and what was skipped."""
    out = []
    for key, line in (("nccl", _nccl_line), ("from_pretrained", _load_line), ("profile", _profile_line),
                      ("pytest_gpu", _suite_line), ("pytest", _suite_line)):
        if result.get(key):
            out.append(line(result[key], result) + _error(result[key]))
    return out + [f"skipped {s['part']}: {s['reason']}" for s in result.get("skipped", [])]


def _nccl_line(nccl: dict[str, Any], result: dict[str, Any]) -> str:
    return (f"process group: {nccl.get('backend', '-')}, all-reduce ok {nccl.get('all_reduce_ok')}; "
            f"Cluster.detect(): {nccl.get('cluster', '-')}")


def _load_line(fp: dict[str, Any], result: dict[str, Any]) -> str:
    gap = _over(fp.get("loss_rel_gap"), LOSS_RTOL["bf16"])
    return (f"from_pretrained ({len(fp.get('files', []))} files, loaded in {_num(fp.get('load_s'), '.1f')} s on "
            f"{','.join(fp.get('param_devices', [])) or '-'}): first-step loss {_num(fp.get('loss0_fxpar'), '.5f')} "
            f"vs HF forward {_num(fp.get('loss0_hf'), '.5f')}, gap/tol {_num(gap, '.3f')}")


def _profile_line(prof: dict[str, Any], result: dict[str, Any]) -> str:
    """The profile's size and each plan predicted with it, against the arm's measured step."""
    preds = []
    for key, pred in (prof.get("predictions") or {}).items():
        measured = result["arms"].get(key.replace("_", "/"), {}).get("step_s")
        error = (pred["step_s"] - measured) / measured if measured and pred.get("step_s") else None
        pct = "-" if error is None else f"{100 * error:+.0f}%"
        preds.append(f"{key.replace('_', '/')} {_num(pred.get('step_s'), '.4f')} s ({pct})")
    return (f"profile (python {prof.get('command', '-')}): {prof.get('ops', '-')} ops in "
            f"{_num(prof.get('profile_s'), '.1f')} s" + (f"; predicted with it: {', '.join(preds)}" if preds else ""))


def _suite_line(tests: dict[str, Any], result: dict[str, Any]) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(tests.get("counts", {}).items()))
    killed = " (killed at the budget)" if tests.get("killed_at_budget") else ""
    failed = f"; failed: {', '.join(tests['failed'][:20])}" if tests.get("failed") else ""
    return (f"test suite ({tests.get('command', '-')}): {counts or 'no results'} of {tests.get('collected', '?')} "
            f"in {_num(tests.get('wall_s'), '.0f')} s{killed}{failed}")


def _error(record: dict[str, Any]) -> str:
    return f"; ERROR {record['error']}" if record.get("error") else ""
