"""``fxpar plan --emit DIR``: write what each rank runs, for inspection.

- ``plan.json``: the plan.
- data parallel: ``rank_<r>.json``, the rank's share and micro-batches; every rank runs the
  unchanged model, so there is no generated code.
- pipeline: ``stage_<j>.py``, the stage's generated FX code (its piece of the exported graph);
  ``stage_<j>.json``, the values it receives and sends, the parameters it owns (original FQNs)
  and the ranks that run it.

The model is split on the meta device, so emitting a plan allocates no weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fxpar.plan import Plan


def emit(plan: Plan, model: torch.nn.Module | None, example_inputs: dict[str, Any] | None,
         directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json"]
    written[0].write_text(plan.to_json())
    if plan.strategy == "data_parallel":
        for r in plan.ranks:
            path = out / f"rank_{r.rank}.json"
            path.write_text(json.dumps({"rank": r.rank, "device": r.device, "runs": "the unchanged model",
                                        "batch_share": r.batch_share, "micro_batch_size": r.micro_batch_size,
                                        "num_microbatches": r.num_microbatches,
                                        "batch_offset": plan.batch_offsets()[r.rank]}, indent=2))
            written.append(path)
        return written
    from fxpar.codegen.hand_plans import block_paths
    from fxpar.codegen.pipeline_parallel import layer_to_stage
    from fxpar.codegen.pipeline_split import split_stages

    assert model is not None and example_inputs is not None
    modules, _ = split_stages(model, example_inputs, layer_to_stage(plan, block_paths(model)), len(plan.stages))
    for st, mod in zip(plan.stages, modules):
        code = out / f"stage_{st.index}.py"
        code.write_text(f"# fxpar stage {st.index} of {len(plan.stages)}: {st.device}, ranks {list(st.ranks)}\n"
                        f"# receives {list(mod.spec.inputs)}\n# sends {list(mod.spec.outputs)}\n"
                        + mod.piece.code)
        meta = out / f"stage_{st.index}.json"
        meta.write_text(json.dumps({"stage": st.index, "ranks": list(st.ranks), "device": st.device,
                                    "tensor_parallel": st.tensor_parallel, "receives": list(mod.spec.inputs),
                                    "sends": list(mod.spec.outputs), "parameters": list(mod.spec.params),
                                    "activation_checkpointing": plan.activation_checkpointing}, indent=2))
        written += [code, meta]
    return written
