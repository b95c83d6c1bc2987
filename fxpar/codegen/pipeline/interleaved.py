"""Interleaved pipelines with uneven stage counts: a rank may hold several non-adjacent stages
(a fast card taking stages 0 and 2 of 3, the slow one stage 1), each a piece of the exported
graph, run by ``torch.distributed.pipelining``'s multi-stage runtime on the lock-step action
table of :mod:`fxpar.sim.interleaved` (plan ``schedule = "interleaved"``).

Layout: ``P`` pipelines; stage ``j`` of pipeline ``p`` runs on ``stages[j].ranks[p]`` (width 1),
pipeline ``p`` on its ``data_split[p]`` rows (its ranks' speeds and kinds may differ from the
other pipelines').  Within a pipeline the stage -> rank pattern (by position in the pipeline's
sorted ranks) is the same for every pipeline.  Gradients, as for 1F1B
(:mod:`fxpar.codegen.pipeline.module`): each micro-batch's loss is weighted by its samples'
label tokens over the global batch's; a weight read by stages on two ranks (tied embeddings) is
summed over those ranks (on one rank the stages share the tensor, so its gradient is already
the sum); the ranks at the same position of every pipeline sum.  So the update equals one
process on the global batch whatever each pipeline's share and each sample's ``-100`` labels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.codegen.common.materialize import (
    is_meta_model,
    materialize,
    stage_slots,
    to_meta,
    weights_source,
)
from fxpar.codegen.pipeline.module import (
    PipelineParallelModule,
    layer_to_stage,
    on_device,
)
from fxpar.codegen.pipeline.ties import TiedParam, alias_groups, canonical_names
from fxpar.codegen.pipeline.tensor_stages import example_values, wrap_stage
from fxpar.compat import pipeline_action, pipeline_stage_class, set_stage_mapping
from fxpar.errors import PlanError, RuntimeSetupError
from fxpar.plan import Plan
from fxpar.runtime.device import plan_rank_device
from fxpar.runtime.emulation import SegmentClock, SpeedEmulator
from fxpar.runtime.loss_scale import scaler_for
from fxpar.sim.interleaved import check_placement, lockstep_order
from fxpar.tracing.structure import block_path


def placement(plan: Plan) -> tuple[list[list[int]], list[int]]:
    """``(pipeline ranks (sorted) per pipeline, stage -> position in its pipeline)``; a
    PlanError when the pipelines do not share one pattern."""
    P = plan.pipelines
    if any(st.tensor_parallel != 1 or len(st.ranks) != P for st in plan.stages):
        raise PlanError("an interleaved plan runs stages of tensor-parallel width 1, one rank per pipeline")
    pipes = [sorted({st.ranks[p] for st in plan.stages}) for p in range(P)]
    patterns = {tuple(pipes[p].index(st.ranks[p]) for st in plan.stages) for p in range(P)}
    if len(patterns) != 1 or any(set(pipes[p]) & set(pipes[q]) for p in range(P) for q in range(p)):
        raise PlanError("interleaved plan: every pipeline must own its own ranks and place its stages alike")
    stage_rank = list(next(iter(patterns)))
    try:
        check_placement(stage_rank, len(pipes[0]))
    except ValueError as exc:
        raise PlanError(f"interleaved plan: {exc}") from None
    return pipes, stage_rank


class InterleavedPipelineModule(PipelineParallelModule):
    """This rank's stages of an interleaved plan; ``step(global_batch)`` trains one step."""

    def __init__(self, model: torch.nn.Module, plan: Plan, rank: int, example_inputs: dict[str, Any],
                 *, emulate: bool = True, device: torch.device | str | None = None,
                 checkpoint: str | Path | None = None) -> None:
        torch.nn.Module.__init__(self)
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeSetupError("a pipeline plan runs on an initialised process group")
        pipes, stage_rank = placement(plan)
        S, P = len(plan.stages), plan.pipelines
        self.plan, self.rank, self._original = plan, rank, [model]
        self.device = plan_rank_device(plan, rank, device)
        source = weights_source(model, checkpoint)  # checked on every rank, before any collective
        self.loss_scaler = scaler_for(plan.dtype)
        self.pipeline_index = next(p for p in range(P) if rank in pipes[p])
        self.position = pipes[self.pipeline_index].index(rank)
        self.stage_indices = [j for j in range(S) if stage_rank[j] == self.position]
        self.stage_index = self.stage_indices[0]
        self.tp_group = self.tp_position = None
        self._owners: dict = {}  # the pipelines share their cuts: one group per position
        self.is_lead, self._sharded, self._link = True, False, None
        groups = [dist.new_group(r) for r in pipes]  # every rank creates every group, in order
        dp = [dist.new_group([pipes[p][k] for p in range(P)]) for k in range(len(pipes[0]))]
        self.pp_group = self.pipe_group = groups[self.pipeline_index]
        self.dp_group = dp[self.position]
        self._stage_replicas = (tuple(pipes[p][self.position] for p in range(P)), self.dp_group)
        self.chain = [pipes[self.pipeline_index][stage_rank[j]] for j in range(S)]
        self.emulator = SpeedEmulator(plan.ranks[rank].speed if (emulate and plan.emulated) else 1.0)
        self.clock = SegmentClock(self.emulator)

        blocks = list(dict.fromkeys(b for b in (block_path(n) for n, _ in model.named_modules()) if b))
        one = {k: (v[: plan.ranks[rank].micro_batch_size] if isinstance(v, torch.Tensor) and v.dim() else v)
               for k, v in example_inputs.items()}
        if is_meta_model(model):  # exported and run on shapes only
            one = to_meta(one)
        self._canonical = canonical_names(model)
        self._aliases = alias_groups(self._canonical)
        modules = self._split(model, one, layer_to_stage(plan, blocks))
        self.stage_modules = torch.nn.ModuleList(modules[j] for j in self.stage_indices)
        self.module = self.stage_modules[0]
        # boundary shapes from one pass over the chain (meta: shapes only), before materialising
        examples = [(on_device(i, self.device), on_device(o, self.device))
                    for i, o in example_values(modules, tuple(one[n] for n in self.input_names))]
        for mod in self.stage_modules:
            mod.retarget(self.device)
        if source is not None:  # this rank's stages only (a weight two of them read: one tensor)
            materialize(stage_slots(list(self.stage_modules), model, self._canonical), self.device, source, model)
        else:
            self.stage_modules.to(self.device)
        for j, mod in zip(self.stage_indices, self.stage_modules):
            mod.checkpointing = plan.activation_checkpointing or plan.stages[j].activation_checkpointing
            wrap_stage(mod, self.clock, self.emulator, None)
        self._tied, self._first_tie_stage = self._tie_groups(modules, stage_rank, pipes)
        self._tie_owner = self.position  # _first_tie_stage holds positions here
        stages = [pipeline_stage_class()(mod, j, S, self.device, input_args=examples[j][0],
                                output_args=examples[j][1][0] if len(examples[j][1]) == 1 else examples[j][1],
                                group=self.pp_group)
                  for j, mod in zip(self.stage_indices, self.stage_modules)]
        fwd = [st.predicted_fwd_s for st in plan.stages]
        bwd = [st.predicted_bwd_s for st in plan.stages]
        timed = all(f > 0 for f in fwd) and all(b > 0 for b in bwd)  # the planner's order, when it made one
        order = lockstep_order(stage_rank, len(pipes[0]), plan.num_microbatches,
                               fwd if timed else None, bwd if timed else None)
        schedule = PipelineScheduleMulti(stages, n_microbatches=plan.num_microbatches,
                                         loss_fn=self._scaled_loss, scale_grads=False)
        schedule.pipeline_order = {r: [None if a is None else pipeline_action(a[1], a[0], a[2]) for a in acts]
                                   for r, acts in order.items()}
        set_stage_mapping(schedule, schedule.pipeline_order)
        self.schedule = schedule
        if P > 1 and source is None:  # a real model: every pipeline starts from the first one's weights
            with torch.no_grad():
                for _, p in self.named_original_parameters():
                    dist.broadcast(p.data, src=pipes[0][self.position], group=self.dp_group)

    # ---- set-up helpers -----------------------------------------------------------------
    def _tie_groups(self, modules, stage_rank: list[int], pipes: list[list[int]]):
        """Weights read on several positions of a pipeline (this rank's entries, summed over
        those ranks of this pipeline by ``sync_tied``) and the first position of every such
        weight."""
        readers: dict[str, set[int]] = {}
        for j, mod in enumerate(modules):
            for fqn, _ in mod.named_original_parameters():
                readers.setdefault(self._canonical.get(fqn, fqn), set()).add(stage_rank[j])
        mine = {self._canonical.get(f, f): p for f, p in self.named_original_parameters()}
        ties, first = [], {}
        for name in sorted(readers):
            positions = sorted(readers[name])
            if len(positions) < 2:
                continue
            first[name] = positions[0]
            groups = [dist.new_group([pipes[p][k] for k in positions]) for p in range(len(pipes))]
            if self.position in positions:
                ties.append(TiedParam(name, mine[name], positions[0], groups[self.pipeline_index]))
        return ties, first

    # ---- training -------------------------------------------------------------------------
    def named_original_parameters(self):
        """(FQN, parameter) of this rank's stages, each tensor once."""
        seen: set[int] = set()
        for mod in self.stage_modules:
            for fqn, p in mod.named_original_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield fqn, p

    def _where(self) -> str:
        return f"stages {self.stage_indices}"

    def _run_schedule(self, inputs: tuple, losses: list, train: bool, weights: torch.Tensor) -> None:
        S = len(self.plan.stages)
        args = inputs if 0 in self.stage_indices else ()
        kw = {"target": weights, "losses": losses} if S - 1 in self.stage_indices else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kw)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)
