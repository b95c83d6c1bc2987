"""Checkpoints written by an earlier fxpar still load (issue #38 item 3): each stored
``tests/fixtures/checkpoint_<name>/`` (:data:`tests.multirank.make_checkpoint_fixture.FIXTURES`:
a tiny model trained one AdamW step by 2 ranks of one form — tensor parallelism's halves of every
projection, a pipeline of one block per stage, ZeRO-3's ragged 1 : 3 rows, expert parallelism's
3 + 1 experts) loads into one process, resharded to whole tensors, byte for byte: every
parameter and optimizer tensor has the SHA-256 the writing ranks' pieces had
(``tests/fixtures/checkpoint_<name>.json``), and the step, the extra data and the learning rate
come back.

It is in the full tier: the fixtures were written by torch 2.15's ``torch.distributed.checkpoint``,
and CI's full tier runs the newest torch, which must keep reading them; the quick tier's lowest
torch (2.11) is older than the writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpar.checkpoint import load_checkpoint
from tests.multirank.make_checkpoint_fixture import FIXTURES, FIXTURES_DIR, digest
from tests.multirank.workers_ckpt import tiny


def _expected(name: str) -> dict:
    return json.loads((FIXTURES_DIR / f"checkpoint_{name}.json").read_text())


@pytest.mark.full
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_stored_checkpoint_loads_into_one_process_byte_for_byte(name: str):
    kind, arg, config = FIXTURES[name]
    expected = _expected(name)
    assert expected["config"] == config and expected.get("arg", expected.get("kv_shares")) == arg
    model = tiny(seed=7, config=config)    # other weights than the checkpoint's (seed 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = load_checkpoint(model, optimizer, FIXTURES_DIR / f"checkpoint_{name}")
    assert meta.step == expected["step"] and meta.extra == {"source": kind, "arg": arg}
    params = dict(model.named_parameters())
    assert {fqn: digest(p) for fqn, p in params.items()} == expected["params"]
    names = {id(p): fqn for fqn, p in params.items()}
    state = {f"{names[id(p)]}/{key}": (digest(v) if isinstance(v, torch.Tensor) else v)
             for p, st in optimizer.state.items() for key, v in st.items()}
    assert state == expected["optim"]
    assert optimizer.param_groups[0]["lr"] == expected["lr"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_fixture_is_what_the_loader_reads(name: str):
    """Each stored folder is complete (no test silently reads nothing)."""
    expected = _expected(name)
    files = {p.name for p in Path(FIXTURES_DIR / f"checkpoint_{name}").iterdir()}
    assert {".metadata", "fxpar_checkpoint.json", "__0_0.distcp", "__1_0.distcp"} <= files
    assert len(expected["params"]) >= 9 and len(expected["optim"]) == 3 * len(expected["params"])
