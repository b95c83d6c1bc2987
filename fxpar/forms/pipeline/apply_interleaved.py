"""Interleaved pipelines with uneven stage counts: a rank may hold several non-adjacent stages
(a fast card taking stages 0 and 2 of 3, the slow one stage 1), each a piece of the exported
graph, run by ``torch.distributed.pipelining``'s multi-stage runtime on the lock-step action
table of :mod:`fxpar.sim.interleaved` (plan ``schedule = "interleaved"``).

Layout: ``P`` pipelines; stage ``j`` of pipeline ``p`` runs on ``stages[j].ranks[p]`` (width 1),
pipeline ``p`` on its ``data_split[p]`` rows (its ranks' speeds and kinds may differ from the
other pipelines').  Within a pipeline the stage -> rank pattern (by position in the pipeline's
sorted ranks) is the same for every pipeline.  Gradients, as for 1F1B
(:mod:`fxpar.forms.pipeline.apply_module`): each micro-batch's loss is weighted by its samples'
label tokens over the global batch's; a weight read by stages on two ranks (tied embeddings) is
summed over those ranks (on one rank the stages share the tensor, so its gradient is already
the sum); the ranks at the same position of every pipeline sum.  So the update equals one
process on the global batch whatever each pipeline's share and each sample's ``-100`` labels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpar.codegen.common.materialize import Source
from fxpar.forms.pipeline.apply_module import Pipeline
from fxpar.forms.pipeline.apply_stage_setup import (
    layer_to_stage,
    micro_example,
    on_device,
    place_stages,
    torch_stage,
    wants_checkpointing,
)
from fxpar.forms.pipeline.apply_ties import TiedParam
from fxpar.forms.pipeline.apply_replica_sum import counting
from fxpar.codegen.stages.export import example_values
from fxpar.forms.pipeline.apply_tensor_stages import wrap_stage
from fxpar.compat import pipeline_action, set_stage_mapping
from fxpar.plan import Plan
from fxpar.sim.interleaved import lockstep_order
from fxpar.tracing.model_facts import canonical_names, tie_groups
from fxpar.tracing.structure import block_paths


class InterleavedPipeline(Pipeline):
    """Pipeline parallelism applied with an interleaved schedule: this rank's stages of an
    interleaved plan.  Set up as the 1F1B pass is (its ``__init__``); only :meth:`_build` differs."""

    def _build(self, model: torch.nn.Module, plan: Plan, rank: int, example_inputs: dict[str, Any],
               source: Source | None) -> None:
        """This rank's stages (several, non-adjacent) and the multi-stage schedule."""
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        pipes = [list(self.layout.pipeline(p)) for p in range(plan.pipelines)]
        stage_rank = list(self.layout.stage_positions(0))
        self._place_positions(plan, rank, pipes, stage_rank)
        blocks = block_paths(model)
        one = micro_example(model, plan, rank, example_inputs)
        self._canonical, self._ties = canonical_names(model), tie_groups(model)
        modules = self._split(model, one, layer_to_stage(plan, blocks))
        examples = self._own_stages(model, modules, one, source)
        self._tied, self._first_tie_stage = self._tie_groups(modules, stage_rank, pipes)
        self._tie_owner = self.position  # _first_tie_stage holds positions here
        self.schedule = self._multi_schedule(PipelineScheduleMulti, examples, stage_rank, len(pipes[0]))
        if plan.pipelines > 1 and source is None:  # a real model: every pipeline starts from the first one's weights
            with torch.no_grad():
                for _, p in self.named_original_parameters():
                    dist.broadcast(p.data, src=pipes[0][self.position], group=self.dp_group)

    # ---- set-up helpers -----------------------------------------------------------------
    def _place_positions(self, plan: Plan, rank: int, pipes: list[list[int]], stage_rank: list[int]) -> None:
        """This rank's pipeline, position and stages, its groups (a chain per pipeline, one per
        position across the pipelines) and its pipeline's chain."""
        S, place = len(plan.stages), self.layout.where(rank)
        self.pipeline_index, self.stage_indices = place.replica, list(place.stages)
        self.position = pipes[self.pipeline_index].index(rank)
        self.stage_index = self.stage_indices[0]
        self.tp_group = self.tp_position = None
        self._owners: dict = {}  # the pipelines share their cuts: one group per position
        self.is_lead, self._sharded, self._link = True, False, None
        groups = self.groups.make("whole_replica", "replica")   # every rank makes every group, in order
        self.pp_group = self.pipe_group = groups.whole_replica(self.pipeline_index)
        self.dp_group = groups.replica(self.stage_index, 0)
        self._stage_replicas = (self.layout.replica_group(self.stage_index, 0), self.dp_group)
        self.chain = [pipes[self.pipeline_index][stage_rank[j]] for j in range(S)]

    def _own_stages(self, model: torch.nn.Module, modules: list[Any], one: dict[str, Any],
                    source: Source | None) -> list[tuple[tuple, tuple]]:
        """This rank's stages, their tensors on the device and their wrappers; returns every
        stage's boundary example values (on the device)."""
        self.stage_modules = torch.nn.ModuleList(modules[j] for j in self.stage_indices)
        self.m.stage_modules = self.stage_modules   # registered: the module's parameters are every stage's
        self.module = self.stage_modules[0]
        # boundary shapes from one pass over the chain (meta: shapes only), before materialising
        examples = [(on_device(i, self.device), on_device(o, self.device))
                    for i, o in example_values(modules, tuple(one[n] for n in self.input_names))]
        # this rank's stages only (a weight two of them read: one tensor)
        place_stages(list(self.stage_modules), model, self._canonical, self.device, source)
        # one sum across the pipelines for all of them, armed by the first stage: its last
        # backward is the rank's last (each later stage's ends before it, in every schedule)
        self._replica_sum = self._make_replica_sum()
        for j, mod in zip(self.stage_indices, self.stage_modules):
            mod.checkpointing = wants_checkpointing(self.plan, j)
            wrap_stage(mod, self.clock, None, on_forward=counting(self._replica_sum) if j == self.stage_index else None)
        return examples

    def _multi_schedule(self, schedule_class: type, examples: list[tuple[tuple, tuple]], stage_rank: list[int],
                        width: int) -> Any:
        """The multi-stage schedule of this rank's stages on the lock-step action table of
        :mod:`fxpar.sim.interleaved` (``width`` ranks per pipeline), in the planner's order when
        it timed every stage."""
        plan, S = self.plan, len(self.plan.stages)
        stages = [torch_stage(mod, j, S, self.device, examples[j][0], examples[j][1], self.pp_group)
                  for j, mod in zip(self.stage_indices, self.stage_modules)]
        fwd = [st.predicted_fwd_s for st in plan.stages]
        bwd = [st.predicted_bwd_s for st in plan.stages]
        timed = all(f > 0 for f in fwd) and all(b > 0 for b in bwd)  # the planner's order, when it made one
        order = lockstep_order(stage_rank, width, plan.num_microbatches,
                               fwd if timed else None, bwd if timed else None)
        schedule = schedule_class(stages, n_microbatches=plan.num_microbatches,
                                  loss_fn=self._scaled_loss, scale_grads=False)
        schedule.pipeline_order = {r: [None if a is None else pipeline_action(a[1], a[0], a[2]) for a in acts]
                                   for r, acts in order.items()}
        set_stage_mapping(schedule, schedule.pipeline_order)
        return schedule

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
            readers_in = [tuple(pipes[p][k] for k in positions) for p in range(len(pipes))]
            self.groups.make_sets("tie", readers_in)
            if self.position in positions:
                group = self.groups.group("tie", readers_in[self.pipeline_index])
                ties.append(TiedParam(name, mine[name], positions[0], group))
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

    def _position(self) -> str:
        return f"stages {self.stage_indices}"

    def _stages(self) -> list[tuple[int, torch.nn.Module]]:
        return list(zip(self.stage_indices, self.stage_modules))

    def _run_schedule(self, inputs: tuple, losses: list, train: bool, weights: torch.Tensor) -> None:
        S = len(self.plan.stages)
        args = inputs if 0 in self.stage_indices else ()
        kw = {"target": weights, "losses": losses} if S - 1 in self.stage_indices else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kw)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)
