"""A checkpoint written by an earlier fxpar still loads (issue #38 item 3): the stored
``tests/fixtures/checkpoint_tp2/`` — a tiny Llama trained one AdamW step by 2 tensor-parallel
ranks, each holding half of every projection (written by
``python -m tests.multirank.make_checkpoint_fixture``) — loads into one process, resharded to
whole tensors, byte for byte: every parameter and optimizer tensor has the SHA-256 the writing
ranks' pieces had (``tests/fixtures/checkpoint_tp2.json``), and the step, the extra data and the
learning rate come back.

It is in the full tier: the fixture was written by torch 2.15's ``torch.distributed.checkpoint``,
and CI's full tier runs the newest torch, which must keep reading it; the quick tier's lowest
torch (2.11) is older than the writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpar.checkpoint import load_checkpoint
from tests.multirank.make_checkpoint_fixture import CONFIG, FIXTURE, KV_SHARES, digest
from tests.multirank.workers_ckpt import tiny

EXPECTED = json.loads((FIXTURE.parent / "checkpoint_tp2.json").read_text())


@pytest.mark.full
def test_a_stored_tensor_parallel_checkpoint_loads_into_one_process_byte_for_byte():
    assert EXPECTED["config"] == CONFIG and EXPECTED["kv_shares"] == KV_SHARES
    model = tiny(seed=7, config=CONFIG)    # other weights than the checkpoint's (seed 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = load_checkpoint(model, optimizer, FIXTURE)
    assert meta.step == EXPECTED["step"] and meta.extra == {"source": "tp", "arg": KV_SHARES}
    params = dict(model.named_parameters())
    assert {fqn: digest(p) for fqn, p in params.items()} == EXPECTED["params"]
    names = {id(p): fqn for fqn, p in params.items()}
    state = {f"{names[id(p)]}/{key}": (digest(v) if isinstance(v, torch.Tensor) else v)
             for p, st in optimizer.state.items() for key, v in st.items()}
    assert state == EXPECTED["optim"]
    assert optimizer.param_groups[0]["lr"] == EXPECTED["lr"]


def test_the_fixture_is_what_the_loader_reads():
    """The stored folder is complete (no test silently reads nothing)."""
    files = {p.name for p in Path(FIXTURE).iterdir()}
    assert {".metadata", "fxpar_checkpoint.json", "__0_0.distcp", "__1_0.distcp"} <= files
    assert len(EXPECTED["params"]) >= 9 and len(EXPECTED["optim"]) == 3 * len(EXPECTED["params"])
