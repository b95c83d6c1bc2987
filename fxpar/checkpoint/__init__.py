"""Checkpoints that move between plans: save under one plan, load under any other.

    from fxpar.checkpoint import save_checkpoint, load_checkpoint, consolidate_to_hf

    save_checkpoint(pmodel, optimizer, "ckpt/step-100", step=100)       # every rank
    meta = load_checkpoint(other_pmodel, other_optimizer, "ckpt/step-100")  # any plan / world size
    consolidate_to_hf("ckpt/step-100", model_config, "hf-out")           # one process
    latest_checkpoint("ckpt")      # newest complete one (resume after a crash), or None

State is keyed by the original model's FQNs (parameters and Adam-style optimizer state) and
stored with ``torch.distributed.checkpoint``; ragged tensor-parallel shards are described by
their true offsets (``planners.py``), so loading is bit-exact under another data-parallel
world size, a pipeline, a tensor-parallel split or a single process.  Format: ``files.py``;
save/load: ``core.py``; which rank holds what: ``layout.py``; DCP planners: ``planners.py``;
resuming: ``latest.py``.
"""

from fxpar.checkpoint.core import CheckpointMetadata, load_checkpoint, save_checkpoint
from fxpar.checkpoint.files import read_metadata, read_model_state
from fxpar.checkpoint.hf import consolidate_to_hf
from fxpar.checkpoint.latest import latest_checkpoint
from fxpar.checkpoint.layout import Layout, LocalParam, ShardSpec, describe

__all__ = ["CheckpointMetadata", "Layout", "LocalParam", "ShardSpec", "consolidate_to_hf", "describe",
           "latest_checkpoint", "load_checkpoint", "read_metadata", "read_model_state", "save_checkpoint"]
