"""Rank functions for the bad-input survey (tests/multirank/test_bad_input_survey.py) and the lost-rank
test: bad batches given to ``pmodel.step`` on 2 gloo ranks, and a rank that dies mid-step.

Every bad batch here is the same on both ranks (as a global batch is), so a clear error is
raised on both ranks before any collective and the pool stays usable.  Each case returns
``{"case", "type", "fxpar", "message"}`` so the test can check the error class and wording.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from tests.workers import global_batch, tiny_model

Batch = dict[str, torch.Tensor]
#: case name -> (batch maker from a good batch and the plan's per-rank shares, step keyword
#: arguments, words the message must contain)
StepCase = tuple[Callable[[Batch, tuple[int, ...]], Any], dict[str, Any], tuple[str, ...]]


def _rows(b: Batch, n: int) -> Batch:
    return {k: v[:n] for k, v in b.items()}


def _all_ignored(b: Batch) -> Batch:
    return {**b, "labels": torch.full_like(b["labels"], -100)}


def _ignored_rows(b: Batch, start: int, stop: int) -> Batch:
    labels = b["labels"].clone()
    labels[start:stop] = -100
    return {**b, "labels": labels}


def _not_a_share(shares: tuple[int, ...]) -> int:
    return next(n for n in range(1, 1 + sum(shares)) if n not in shares)


def _without(b: Batch, key: str) -> Batch:
    return {k: v for k, v in b.items() if k != key}


COMMON_CASES: dict[str, StepCase] = {
    "wrong leading dim": (lambda b, s: _rows(b, 6), {}, ("6", "8")),
    "keys disagree on rows": (lambda b, s: {**b, "labels": b["labels"][:6]}, {}, ("labels", "6", "8")),
    "missing input_ids": (lambda b, s: _without(b, "input_ids"), {}, ("input_ids",)),
    "missing labels": (lambda b, s: _without(b, "labels"), {}, ("labels",)),
    "labels all -100": (lambda b, s: _all_ignored(b), {}, ("labels", "-100")),
    "float input_ids": (lambda b, s: {**b, "input_ids": b["input_ids"].float()}, {}, ("input_ids",)),
    "seq mismatch": (lambda b, s: {**b, "input_ids": b["input_ids"][:, :12]}, {}, ("input_ids", "12")),
    "batch is None": (lambda b, s: None, {}, ("None",)),
    "batch is a list of dicts": (lambda b, s: [b, b], {}, ("list",)),
    "empty batch": (lambda b, s: _rows(b, 0), {}, ("0",)),
    # a row count that is no rank's share, so every rank refuses it (none waits in a collective)
    "local rows wrong": (lambda b, s: _rows(b, _not_a_share(s)), {"local": True}, ("share", "samples")),
}

def _padded_mask(b: Batch) -> Batch:
    mask = torch.ones_like(b["input_ids"])
    mask[:, :3] = 0
    return {**b, "attention_mask": mask}


PP_CASES: dict[str, StepCase] = {
    **COMMON_CASES,
    # the pipeline was traced without these keys: its stages would drop them unread
    "untraced padded attention_mask": (lambda b, s: _padded_mask(b), {}, ("attention_mask", "example_inputs")),
    "untraced token_type_ids": (lambda b, s: {**b, "token_type_ids": torch.zeros_like(b["input_ids"])}, {},
                                ("token_type_ids", "example_inputs")),
    "a micro-batch all -100": (lambda b, s: _ignored_rows(b, 0, 4), {}, ("labels", "-100", "micro-batch")),
    "vocab out of range": (lambda b, s: {**b, "input_ids": b["input_ids"] + 10_000}, {}, ("input_ids",)),
}


def _outcome(name: str, fn: Callable[[], Any], needles: tuple[str, ...]) -> dict[str, Any]:
    try:
        fn()
    except fxpar.FxparError as exc:
        return {"case": name, "type": type(exc).__name__, "fxpar": True, "message": str(exc),
                "needles": list(needles)}
    except Exception as exc:  # noqa: BLE001 - the survey records what escaped
        return {"case": name, "type": type(exc).__name__, "fxpar": False, "message": str(exc)[:500],
                "needles": list(needles)}
    return {"case": name, "type": None, "fxpar": False, "message": "no error", "needles": list(needles)}


def _run_cases(pm: torch.nn.Module, good: Batch, cases: dict[str, StepCase],
               names: list[str] | None) -> list[dict[str, Any]]:
    lo_hi = [None] * dist.get_world_size()
    dist.all_gather_object(lo_hi, pm.batch_rows())
    shares = tuple(hi - lo for lo, hi in lo_hi)
    out = []
    for name in names or list(cases):
        make, kwargs, needles = cases[name]
        batch = make(good, shares)
        out.append(_outcome(name, lambda b=batch, kw=kwargs: pm.step(b, **kw), needles))
        dist.barrier()
    pm.step(good)  # the module still trains after the refused batches
    return out


def dp_step_survey(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Bad batches for a data-parallel module of speeds (1.0, 0.5) and global batch 8."""
    model = tiny_model("gpt2")
    good = global_batch(model, 8, 16, ignore_some=False)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0, 0.5]), good, emulate=False)
    return _run_cases(pm, good, COMMON_CASES, names)


def pp_step_survey(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Bad batches for a 2-stage pipeline (1 block each, 2 micro-batches of 4)."""
    from fxpar.forms.hand_plans import pipeline_plan

    model = tiny_model("gpt2")
    good = global_batch(model, 8, 16, ignore_some=False)
    plan = pipeline_plan(model, fxpar.Cluster.emulated([1.0, 1.0]), global_batch=8,
                         blocks_per_stage=[1, 1], num_microbatches=2)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0, 1.0]), good, plan=plan, emulate=False)
    ones = {**good, "attention_mask": torch.ones_like(good["input_ids"]), "use_cache": False}   # a flag passes too
    taken = {"case": ALL_ONES_MASK, "without": pm.eval_loss(good).item(), "with": pm.eval_loss(ones).item()}
    return [*_run_cases(pm, good, PP_CASES, names), taken]


#: The survey's record of an untraced all-ones ``attention_mask``: taken, the loss unchanged.
ALL_ONES_MASK = "untraced all-ones attention_mask"


# ---- a rank that disappears ----------------------------------------------------------------

def lost_rank_step(init_file: str, rank: int, timeout_s: float, result_file: str, mode: str) -> None:
    """Process body (spawned): 2 gloo ranks through :func:`fxpar.runtime.init_distributed`.
    After one good step rank 1 is lost before the next step's gradient all-reduce: it exits
    abruptly (``mode="exit"``) or stops answering (``mode="hang"``).  Rank 0 writes what
    ``step`` raised (type, message, seconds) to ``result_file``."""
    import json
    import time

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    from fxpar.runtime import init_distributed

    init_distributed(timeout_s=timeout_s, backend="gloo", init_method=f"file://{init_file}",
                     rank=rank, world_size=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 8)
    pm = fxpar.auto(model, fxpar.Cluster.emulated([1.0, 1.0]), (x,), emulate=False,
                    loss_fn=lambda out, batch: out.pow(2).mean(), forms=["data_parallel"])
    pm.step(x)  # one good step: both ranks alive
    if rank == 1:
        if mode == "hang":  # alive but silent (a stuck process); the test kills it
            time.sleep(120)
        os._exit(17)  # gone without a word, as a killed or crashed process
    start = time.monotonic()
    outcome: dict[str, Any]
    try:
        pm.step(x)
        outcome = {"type": None, "message": "no error"}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = {"type": type(exc).__name__, "fxpar": isinstance(exc, fxpar.FxparError),
                   "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    with open(result_file, "w") as f:
        json.dump(outcome, f)
    os._exit(0)  # the peer is gone: skip destroy_process_group, which may wait for it


