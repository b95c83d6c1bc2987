"""The oracle's pipeline pair (``benchmarks/torch_parity.py``) runs and counts what it says: torch's
own pipelining front end (``pipeline()`` + ``SplitPoint``, ``PipelineStage``, ``Schedule1F1B``) and
fxpar's pipeline on the same cut, one timed step each on 2 gloo ranks.  What is asserted is what
the stored table reads from it: both arms train, each rank sends its stage boundary, fxpar's
first stage sends what torch's does less the export's causal mask (which fxpar's ``is_causal``
stages never build) plus the labels, and fxpar reads nothing on the host.  Kept in the full suite so a torch release that changes the pipelining API shows here
before a benchmark run does (torch 2.11's ``pipeline()`` cannot split this Llama: the pair needs
the newer torch the full suite runs on; 2.15 can).
"""

from __future__ import annotations

import math

import pytest

from benchmarks.torch_parity import BATCH, MICRO, SEQ, arm_worker

pytestmark = [pytest.mark.multirank, pytest.mark.full]


def test_the_pipeline_pair_runs_and_fxpar_sends_no_causal_mask(pool2):
    torch_ranks = pool2.run(arm_worker, "torch PP", "fp32", 1, timeout=600)
    fxpar_ranks = pool2.run(arm_worker, "fxpar PP", "fp32", 1, timeout=600)
    for ranks in (torch_ranks, fxpar_ranks):
        assert all(len(r["times"]) == 1 and math.isfinite(r["times"][0]) for r in ranks)
        assert all(r["bytes"]["send"] > 0 for r in ranks)
    # both first stages send the hidden states and the rotary tables; beyond them torch's sends
    # the causal mask (bool, B x L x L over the micro-batches) and fxpar's the labels (float32,
    # B x L: its last stage reads them from the chain, torch's from the schedule's target)
    first = [{r["rank"]: r for r in ranks}[0]["bytes"]["send"] for ranks in (torch_ranks, fxpar_ranks)]
    assert first[0] - first[1] == BATCH * SEQ * SEQ - 4 * BATCH * SEQ, (first, MICRO)
    assert all(r["cost"]["host_reads"] == 0 for r in fxpar_ranks)
