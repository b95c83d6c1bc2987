"""Writes the stored checkpoints the loading tests read (``tests/fixtures/checkpoint_<name>/``,
:data:`FIXTURES`): a tiny model trained one AdamW step by a 2-rank plan of one form and saved by
:func:`fxpar.checkpoint.save_checkpoint`, with ``checkpoint_<name>.json``: the SHA-256 of every
full parameter and optimizer tensor, assembled from what the two ranks held (not from fxpar's
loader), so a later fxpar or torch that reads it differently fails
``tests/graph/test_stored_checkpoint.py``.

Run once per fixture, when the format is meant to change (then keep the old folder beside the new
one under another name)::

    python -m tests.multirank.make_checkpoint_fixture pp2 zero3_2 ep2
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch

import fxpar
from fxpar.runtime import WorkerPool
from tests.multirank.test_checkpoint import assemble
from tests.multirank.workers_ckpt import ckpt_source

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"
#: small enough to store (every projection still splits over 2 ranks: 2 key/value heads)
CONFIG = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
KV_SHARES = [1, 1]
#: a mixture of experts as small (4 experts, 2 per token)
MOE_CONFIG = dict(CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
#: name -> (the plan kind of :func:`tests.multirank.workers_ckpt.build`, its argument, the model):
#: tensor parallelism's halves of every projection, a pipeline of one block per stage, ZeRO-3's
#: ragged rows (1 : 3 of every parameter) and expert parallelism's 3 + 1 experts
FIXTURES: dict[str, tuple[str, Any, dict]] = {
    "tp2": ("tp", KV_SHARES, CONFIG),
    "pp2": ("pp", [1, 1], dict(CONFIG, num_hidden_layers=2)),
    "zero3_2": ("zero3", [1, 3], CONFIG),
    "ep2": ("ep", [3, 1], MOE_CONFIG),
}


def digest(tensor: torch.Tensor) -> dict:
    """A tensor's shape, dtype and the SHA-256 of its bytes."""
    t = tensor.detach().contiguous()
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}


def write(name: str) -> None:
    """Write fixture ``name`` of :data:`FIXTURES` and its expected digests."""
    kind, arg, config = FIXTURES[name]
    folder = FIXTURES_DIR / f"checkpoint_{name}"
    shutil.rmtree(folder, ignore_errors=True)
    with WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        results = pool.run(ckpt_source, kind, arg, str(folder), config)
    assert all(r["layout_ok"] for r in results), "a rank holds other weights than its layout says"
    full = assemble(results)
    expected = {
        "written": f"{date.today()} by fxpar {fxpar.__version__}, torch {torch.__version__}: "
                   f"python -m tests.multirank.make_checkpoint_fixture {name}",
        "config": config, "kind": kind, "arg": arg, "step": 1, "lr": 1e-2,
        "params": {fqn: digest(t) for fqn, t in sorted(full["params"].items())},
        "optim": {f"{fqn}/{key}": (digest(v) if isinstance(v, torch.Tensor) else v)
                  for (fqn, key), v in sorted(full["optim"].items())},
    }
    (FIXTURES_DIR / f"checkpoint_{name}.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"wrote {folder} ({size / 1024:.0f} KiB) and {FIXTURES_DIR / f'checkpoint_{name}.json'}")


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in FIXTURES]
    if not names or unknown:
        raise SystemExit(f"name the fixtures to write, of {sorted(FIXTURES)} (got {names})")
    for name in names:
        write(name)


if __name__ == "__main__":
    main(sys.argv[1:])
