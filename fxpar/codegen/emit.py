"""``fxpar plan --emit DIR``: write what each rank runs, for inspection.

- ``plan.json``: the plan.
- data parallel: ``rank_<r>.json``, the rank's share and micro-batches; every rank runs the
  unchanged model, so there is no generated code.
- sharded data parallel: ``rank_<r>.json``, the rank's rows of the batch, its state weight, the
  sharding stage, whether it recomputes blocks and offloads its optimizer, and (with the model)
  its rows ``[lo, hi)`` of every parameter (:func:`fxpar.runtime.ragged.owned_rows`) with the
  fraction of the model's elements they hold.
- expert parallel: ``rank_<r>.json``, the rank's rows, its experts ``[lo, hi)`` of every MoE
  layer (the rest of the model is replicated; tokens reach their experts by all-to-all).
- tensor parallel: ``position_<t>.py``, the exported graph of the model as position ``t`` of
  every tensor-parallel group holds it (local weight shapes, ``fxpar.tp_copy`` /
  ``fxpar.tp_reduce`` where the group communicates); ``rank_<r>.json`` says which replica,
  position, key/value heads and rows rank ``r`` has.
- pipeline: ``stage_<j>.py``, the stage's generated FX code (its piece of the exported graph);
  ``stage_<j>.json``, the values it receives and sends, the parameters it owns (original FQNs)
  and the ranks that run it.  A tensor-parallel stage also gets ``stage_<j>_position_<t>.py``,
  the code of each position's shard, and its JSON lists the positions.

The model is split on the meta device, so emitting a plan allocates no weights.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.pipeline.stage_setup import layer_to_stage
from fxpar.codegen.pipeline.split import split_stages
from fxpar.codegen.tensor.families import split_sizes
from fxpar.codegen.tensor.layout import tp_layout
from fxpar.codegen.tensor.module import shard_model
from fxpar.plan import Plan
from fxpar.runtime.ragged import owned_rows
from fxpar.tracing.structure import block_paths


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json"]
    written[0].write_text(plan.to_json())
    offsets = plan.batch_offsets()
    if plan.strategy == "data_parallel":
        for r in plan.ranks:
            written.append(_write_json(out / f"rank_{r.rank}.json", {
                "rank": r.rank, "device": r.device, "runs": "the unchanged model",
                "batch_share": r.batch_share, "micro_batch_size": r.micro_batch_size,
                "num_microbatches": r.num_microbatches, "batch_offset": offsets[r.rank]}))
        return written
    if plan.strategy == "sharded_data_parallel":
        return written + _emit_sharded(plan, model, out)
    if plan.strategy == "expert_parallel":
        split = plan.stages[0].expert_split
        for r in plan.ranks:
            lo = sum(split[: r.rank])
            written.append(_write_json(out / f"rank_{r.rank}.json", {
                "rank": r.rank, "device": r.device, "batch_share": r.batch_share,
                "batch_offset": offsets[r.rank], "micro_batch_size": r.micro_batch_size,
                "num_microbatches": r.num_microbatches, "experts": [lo, lo + split[r.rank]],
                "runs": "the model with every MoE layer's experts cut to [lo, hi); routed tokens "
                        "travel to their experts' ranks and back by all_to_all_single"}))
        return written

    if model is None or example_inputs is None:
        raise ValueError(f"emit: a {plan.strategy} plan needs the model and example inputs")
    blocks = block_paths(model)
    if plan.strategy == "tensor_parallel":
        return written + _emit_tensor_parallel(plan, model, example_inputs, blocks, out)
    stage_of = layer_to_stage(plan, blocks)
    modules, _ = split_stages(model, example_inputs, stage_of, len(plan.stages))
    for st, mod in zip(plan.stages, modules):
        code = out / f"stage_{st.index}.py"
        code.write_text(f"# fxpar stage {st.index} of {len(plan.stages)}: {st.device}, ranks {list(st.ranks)}\n"
                        f"# receives {list(mod.spec.inputs)}\n# sends {list(mod.spec.outputs)}\n"
                        + mod.piece.code)
        meta = {"stage": st.index, "ranks": list(st.ranks), "device": st.device,
                "tensor_parallel": st.tensor_parallel, "receives": list(mod.spec.inputs),
                "sends": list(mod.spec.outputs), "parameters": list(mod.spec.params),
                "activation_checkpointing": plan.activation_checkpointing or st.activation_checkpointing}
        written.append(code)
        if st.tensor_parallel > 1:
            own = {b for b, j in zip(blocks, stage_of) if j == st.index}
            meta["positions"] = []
            for t, shares in enumerate(_positions(model, st.tensor_parallel, st.tensor_split)):
                sharded = _shard_copy(model, shares, t, own)
                piece = split_stages(sharded, example_inputs, stage_of, len(plan.stages))[0][st.index]
                path = out / f"stage_{st.index}_position_{t}.py"
                path.write_text(f"# fxpar stage {st.index}, tensor-parallel position {t} of "
                                f"{st.tensor_parallel} ({shares[t]} key/value head groups)\n" + piece.piece.code)
                meta["positions"].append({"position": t, "kv_heads": shares[t], "code": path.name,
                                          "ranks": list(st.ranks[t::st.tensor_parallel])})
                written.append(path)
        written.append(_write_json(out / f"stage_{st.index}.json", meta))
    return written


def _positions(model: torch.nn.Module, width: int, tensor_split: Any) -> list[list[int]]:
    """Key/value head groups per position, one list per position (each the full split)."""
    config = model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    shares = list(tensor_split[:width]) if tensor_split is not None else split_sizes(kv, [1] * width)
    return [shares] * width


def _shard_copy(model: torch.nn.Module, shares: list[int], position: int, blocks: set[str] | None):
    sharded = copy.deepcopy(model)
    with warnings.catch_warnings():  # the dropout warning is for training, not for inspection
        warnings.simplefilter("ignore", UserWarning)
        shard_model(sharded, shares, position, None, None, blocks=blocks)
    return sharded


def _emit_tensor_parallel(plan: Plan, model: torch.nn.Module, example_inputs: dict[str, Any],
                          blocks: list[str], out: Path) -> list[Path]:
    layout = tp_layout(plan)
    written = []
    for t in range(layout.width):
        sharded = _shard_copy(model, list(layout.kv_shares), t, None)
        whole = split_stages(sharded, example_inputs, [0] * len(blocks), 1)[0][0]
        path = out / f"position_{t}.py"
        path.write_text(f"# fxpar tensor-parallel position {t} of {layout.width} "
                        f"({layout.kv_shares[t]} key/value head groups)\n" + whole.piece.code)
        written.append(path)
    for r in plan.ranks:
        replica, t = layout.replica(r.rank), layout.position(r.rank)
        lo, hi = layout.row_range(replica)
        written.append(_write_json(out / f"rank_{r.rank}.json", {
            "rank": r.rank, "device": r.device, "replica": replica, "position": t,
            "kv_heads": layout.kv_shares[t], "rows": [lo, hi], "code": f"position_{t}.py",
            "tensor_parallel_group": layout.tp_ranks(replica), "data_parallel_group": layout.dp_ranks(t)}))
    return written


def _emit_sharded(plan: Plan, model: torch.nn.Module | None, out: Path) -> list[Path]:
    """``rank_<r>.json`` of a sharded data-parallel plan (module docstring)."""
    stage, offsets = plan.stages[0], plan.batch_offsets()
    params = dict(model.named_parameters()) if model is not None else {}
    total = sum(p.numel() for p in params.values())
    written = []
    for r in plan.ranks:
        rows = {n: list(owned_rows(tuple(p.shape), stage.state_split)[r.rank]) + [p.shape[0] if p.dim() else 1]
                for n, p in params.items()}
        held = sum((hi - lo) * (p.numel() // max(1, of)) for (lo, hi, of), p in zip(rows.values(), params.values()))
        data = {"rank": r.rank, "device": r.device, "batch_share": r.batch_share, "batch_offset": offsets[r.rank],
                "micro_batch_size": r.micro_batch_size, "num_microbatches": r.num_microbatches,
                "state_weight": stage.state_split[r.rank], "state_split": list(stage.state_split),
                "shard_stage": stage.shard_stage, "activation_checkpointing": r.activation_checkpointing,
                "offload_optimizer": r.offload_optimizer,
                "runs": "the model with each parameter's rows [lo, hi) of `rows` held as its shard (with its "
                        "gradient and optimizer state); " + ("blocks all-gathered around their forward and "
                        "backward" if stage.shard_stage == 3 else "full parameters all-gathered each step")
                        + ", gradients reduce-scattered into the shards"}
        if model is not None:
            data["rows"] = {n: v for n, v in rows.items()}
            data["state_fraction"] = held / total if total else 0.0
        written.append(_write_json(out / f"rank_{r.rank}.json", data))
    return written
