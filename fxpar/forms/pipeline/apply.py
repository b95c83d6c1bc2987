"""Pipeline parallelism applied: the pass of the rank's module (:class:`~fxpar.forms.pipeline.apply_module.Pipeline`,
interleaved or not) and the files ``fxpar plan --emit`` writes (:mod:`fxpar.forms`, phase
``apply``; the module is built by :func:`fxpar.build.build_module`, which owns the groups and
hooks the build makes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxpar.codegen.emit import positions, shard_copy, write_json
from fxpar.forms.pipeline.apply_interleaved import InterleavedPipeline
from fxpar.forms.pipeline.apply_module import Pipeline
from fxpar.codegen.stages.split import split_stages
from fxpar.forms.pipeline.apply_stage_setup import layer_to_stage
from fxpar.codegen.tensor.families import with_split
from fxpar.plan import Plan
from fxpar.tensor_layers import splits_layers
from fxpar.runtime.form_pass import FormPass
from fxpar.tracing.structure import block_paths


def form_pass(plan: Plan) -> type[FormPass]:
    """This rank's stage(s) of the pipeline, exported on ``example_inputs`` (or from the
    module's ``exports``); an interleaved plan's several stages run by the multi-stage schedule."""
    return InterleavedPipeline if plan.schedule == "interleaved" else Pipeline


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         out: Path) -> list[Path]:
    """``stage_<j>.py``: the stage's generated FX code (its piece of the exported graph);
    ``stage_<j>.json``: the values it receives and sends, the parameters it owns (original FQNs)
    and the ranks that run it.  A tensor-parallel stage also gets ``stage_<j>_position_<t>.py``,
    the code of each position's shard, and its JSON lists the positions."""
    if model is None or example_inputs is None:
        raise ValueError(f"emit: a {plan.form} plan needs the model and example inputs")
    blocks, written = block_paths(model), []
    layers = with_split(plan, model).tensor_layers if splits_layers(plan) else None
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
            for t, shares in enumerate(positions(model, st.tensor_parallel, st.tensor.split if st.tensor is not None else None)):
                sharded = shard_copy(model, shares, t, own, layers)
                piece = split_stages(sharded, example_inputs, stage_of, len(plan.stages))[0][st.index]
                path = out / f"stage_{st.index}_position_{t}.py"
                path.write_text(f"# fxpar stage {st.index}, tensor-parallel position {t} of "
                                f"{st.tensor_parallel} ({shares[t]} key/value head groups)\n" + piece.piece.code)
                meta["positions"].append({"position": t, "kv_heads": shares[t], "code": path.name,
                                          "ranks": list(st.ranks[t::st.tensor_parallel])})
                written.append(path)
        written.append(write_json(out / f"stage_{st.index}.json", meta))
    return written
