"""Writes the stored checkpoint the loading tests read (``tests/fixtures/checkpoint_tp2/``): a
tiny Llama trained one AdamW step by a 2-rank tensor-parallel plan (each rank its half of every
projection) and saved by :func:`fxpar.checkpoint.save_checkpoint`, with ``expected.json``: the
SHA-256 of every full parameter and optimizer tensor, assembled from what the two ranks held
(not from fxpar's loader), so a later fxpar or torch that reads it differently fails
``tests/graph/test_stored_checkpoint.py``.

Run once, when the format is meant to change (then keep the old folder beside the new one)::

    python -m tests.multirank.make_checkpoint_fixture
"""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import date
from pathlib import Path

import torch

import fxpar
from fxpar.runtime import WorkerPool
from tests.multirank.test_checkpoint import assemble
from tests.multirank.workers_ckpt import ckpt_source

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_tp2"
#: small enough to store (every projection still splits over 2 ranks: 2 key/value heads)
CONFIG = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
KV_SHARES = [1, 1]


def digest(tensor: torch.Tensor) -> dict:
    """A tensor's shape, dtype and the SHA-256 of its bytes."""
    t = tensor.detach().contiguous()
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}


def main() -> None:
    shutil.rmtree(FIXTURE, ignore_errors=True)
    with WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        results = pool.run(ckpt_source, "tp", KV_SHARES, str(FIXTURE), CONFIG)
    assert all(r["layout_ok"] for r in results), "a rank holds other weights than its layout says"
    full = assemble(results)
    expected = {
        "written": f"{date.today()} by fxpar {fxpar.__version__}, torch {torch.__version__}: "
                   "python -m tests.multirank.make_checkpoint_fixture",
        "config": CONFIG, "kv_shares": KV_SHARES, "step": 1, "lr": 1e-2,
        "params": {fqn: digest(t) for fqn, t in sorted(full["params"].items())},
        "optim": {f"{fqn}/{name}": (digest(v) if isinstance(v, torch.Tensor) else v)
                  for (fqn, name), v in sorted(full["optim"].items())},
    }
    (FIXTURE.parent / "checkpoint_tp2.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    print(f"wrote {FIXTURE} ({size / 1024:.0f} KiB) and {FIXTURE.parent / 'checkpoint_tp2.json'}")


if __name__ == "__main__":
    main()
