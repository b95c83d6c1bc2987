"""The set-up steps the pipeline modules share (:mod:`fxpar.forms.pipeline.apply_module` and
:mod:`fxpar.forms.pipeline.apply_interleaved`): the process-group check, the rank's speed clock,
the repeated blocks and the stage each one belongs to, the one-micro-batch example the export
traces, each stage's placement on the rank's device (materialised from the source of the
values, or moved) and its torch ``PipelineStage``, the schedule's weighted loss; and what a
tensor-parallel stage needs of the model (shardable blocks, key/value head groups to split).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.codegen.common.materialize import (
    Source,
    is_meta_model,
    like_on,
    materialize,
    stage_slots,
    to_meta,
)
from fxpar.forms.pipeline.apply_replicas import stage_modules
from fxpar.codegen.tensor.families import (
    head_layout,
    refusal,
    shardable_blocks,
    split_sizes,
)
from fxpar.compat import pipeline_stage_class, set_stage_ranks
from fxpar.errors import PlanError, RuntimeSetupError
from fxpar.plan import Plan, StagePlan
from fxpar.tensor_layers import TPAnalysis
from fxpar.runtime.compile import CompileOptions, RegionalCompile


def check_process_group() -> None:
    """A RuntimeSetupError unless a process group is initialised (a pipeline runs on one)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeSetupError("a pipeline plan runs on an initialised process group")


def layer_to_stage(plan: Plan, block_paths: list[str], pipeline: int = 0) -> list[int]:
    """Stage index of each repeated block in pipeline ``pipeline``, from the stages' module lists."""
    owner = {m: st.index for st in plan.stages for m in stage_modules(st, pipeline)}
    missing = [b for b in block_paths if b not in owner]
    if missing:
        raise PlanError(f"pipeline plan does not place blocks {missing[:3]}; every block must "
                        "belong to one stage (re-plan for this model)")
    return [owner[b] for b in block_paths]


def weighted_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss_fn: the micro-batch's mean loss times ``N_mb / N`` (the sum of its
    samples' weights, carried as the schedule's ``target``)."""
    return output.float() * target.sum()


def on_device(values: Any, device: torch.device) -> Any:
    """Tensors in ``values`` (a tuple of example values) on ``device``: real ones moved, meta
    ones (a meta model's stage boundaries) as uninitialised tensors of their shape and flags."""
    return like_on(values, device)


def micro_example(model: torch.nn.Module, plan: Plan, rank: int, example_inputs: dict[str, Any]) -> dict[str, Any]:
    """The example inputs cut to one of the rank's micro-batches (what the export traces); on
    ``meta`` for a meta model (exported and run on shapes only)."""
    one = {k: (v[: plan.ranks[rank].micro_batch_size] if isinstance(v, torch.Tensor) and v.dim() else v)
           for k, v in example_inputs.items()}
    return to_meta(one) if is_meta_model(model) else one


def wants_checkpointing(plan: Plan, stage: int) -> bool:
    """Whether stage ``stage`` recomputes its forward during backward (the plan's or the stage's
    activation checkpointing)."""
    return plan.activation_checkpointing or plan.stages[stage].activation_checkpointing


def place_stages(stages: Sequence[Any], model: torch.nn.Module, canonical: dict[str, str],
                 device: torch.device, source: Source | None) -> None:
    """This rank's stages retargeted to ``device`` and their tensors there: materialised from
    ``source`` (a weight two of them read: one tensor), or moved when there is none."""
    for mod in stages:
        mod.retarget(device)
    if source is not None:
        materialize(stage_slots(list(stages), model, canonical), device, source, model)
    else:
        for mod in stages:
            mod.to(device)


def torch_stage(module: torch.nn.Module, stage: int, num_stages: int, device: torch.device,
                stage_in: tuple, stage_out: tuple, group: Any, chain: list[int] | None = None) -> Any:
    """The torch ``PipelineStage`` running ``module`` as stage ``stage`` (its p2p buffers shaped
    like the boundary example values ``stage_in`` / ``stage_out``) over ``group``; ``chain``: the
    global rank of each stage, where a single-stage schedule runs it (:func:`set_stage_ranks`)."""
    out = pipeline_stage_class()(module, stage, num_stages, device, input_args=stage_in,
                                 output_args=stage_out[0] if len(stage_out) == 1 else stage_out, group=group)
    if chain is not None:
        set_stage_ranks(out, chain)
    return out


def check_tp_stages(model: torch.nn.Module, split: TPAnalysis, wide: dict[int, list[str]], widest: int) -> int:
    """The model's key/value head groups, once every tensor-parallel stage (``wide``: stage ->
    its blocks; the widest ``widest`` ranks) is found to hold a block the per-layer ``split``
    (the plan's ``tensor_layers``) shards, and the head groups enough to split.  A stage's other
    blocks (Gemma-3n's AltUp projections, a hybrid's
    state-space layers) run whole on each of its ranks, on the same replicated activations:
    exact, their gradients the same on every rank, as in a tensor-parallel plan."""
    shardable = shardable_blocks(split)
    # checked alike on every rank, before any collective: a refusal on some ranks only
    # would leave the others waiting
    for stage, blocks in sorted(wide.items()):
        if blocks and not shardable.intersection(blocks):
            raise PlanError(
                f"pipeline plan: tensor-parallel stage {stage} holds only blocks {blocks[:3]} of "
                f"{type(model).__name__}, which have no attention fxpar can shard ("
                f"{refusal(split, blocks)}); re-plan with max_tensor_parallel=1 for this model")
    kv, _, _ = head_layout(model, split)
    if kv < widest:
        raise PlanError(f"pipeline plan: a stage has tensor_parallel {widest}, but "
                        f"{type(model).__name__} has {kv} key/value head groups to split; re-plan "
                        "with max_tensor_parallel <= " + str(kv))
    return kv


def tp_shares(stage: StagePlan, pipeline: int, width: int, kv: int) -> tuple[list[int], list[int] | None]:
    """Pipeline ``pipeline``'s shares of a stage's ``kv`` head groups over its ``width`` ranks
    (the plan's ``tensor.split``, else even) and of its experts (``expert.split``, else None)."""
    if stage.tensor is not None:
        shares = list(stage.tensor.split[pipeline * width:][: width])
    else:
        shares = split_sizes(kv, [1] * width)
    experts = (list(stage.expert.split[pipeline * width:][: width])
               if stage.expert is not None else None)
    return shares, experts


def compile_stages(stages: Sequence[tuple[int, torch.nn.Module]], options: CompileOptions) -> RegionalCompile:
    """Each stage's compute compiled (:mod:`fxpar.runtime.compile`): an exported stage's graph
    (its ``piece``) as one region, whole; an eager stage's blocks with graph breaks allowed."""
    compiled = RegionalCompile(options)
    for index, stage in stages:
        piece = getattr(stage, "piece", None)
        if piece is not None:
            # the split makes pieces whose code is written at their first run (compat.lazy_graph_modules):
            # reading ``code`` writes it now, since torch.compile cannot trace the call that would
            piece.code  # noqa: B018
            piece.forward = compiled.compile(f"stage {index}", piece.forward, fullgraph=True)
        else:
            stage._blocks = compiled.compile(f"stage {index} blocks", stage._blocks, fullgraph=False)
    return compiled
