"""How the ranks of one tensor-parallel pipeline stage run its schedule together, and the
pipeline's process groups.

Layout (:class:`fxpar.rank_layout.RankLayout` answers it).  ``P`` pipelines, stage ``j`` of width
``u_j`` (``stages[j].tensor_parallel``): the stage's ranks are listed pipeline-major,
``stages[j].ranks[p·u_j + t]`` = position ``t`` of stage ``j`` in pipeline ``p``.  Widths may
differ between stages (the planner gives each device kind its own tensor-parallel width).

Lead and followers.  Position 0 of a stage (its *lead*) is the stage's member of the pipeline's
point-to-point chain and runs ``torch.distributed.pipelining``'s schedule; positions ``t > 0``
(*followers*) hold other shards of the same blocks and must run every forward and backward of
the stage in the same order, because the blocks' all-reduces pair them.  Before each forward
the lead broadcasts, over the stage's tensor-parallel group, a header (``FWD`` / ``FWD_NOGRAD``)
and the stage's inputs; a joint autograd node on the stage's outputs broadcasts ``BWD`` and the
output gradients when the schedule runs that micro-batch's backward; ``DONE`` ends the step.
Followers replay: forward on the received inputs (kept, in order: 1F1B and GPipe run the
backwards of a stage in forward order), backward on the received gradients, then scale their
gradients by ``1/m`` as the schedule does on the lead.  Every rank of the group thus computes
on identical inputs; outputs and input gradients agree across the group (replicated values
after ``tp_reduce`` / ``tp_copy``), so the lead's sends are everyone's.

Groups, created by every rank in this order: the ``P`` lead chains (point-to-point), one
data-parallel group per (stage, position) across pipelines, one tensor-parallel group per
(stage, pipeline) of width > 1, one group per pipeline holding all its ranks (loss broadcast,
gradient norm; the chain itself when every width is 1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxpar.runtime.plan_groups import PlanGroups
from fxpar.compat import end_of_backward
from fxpar.errors import PlanError
from fxpar.runtime.device import host_tensor
from fxpar.runtime.distributed import host_group
from fxpar.runtime.emulation import SegmentClock

FWD, FWD_NOGRAD, BWD, DONE = 1, 2, 3, 4


@dataclass(slots=True)
class PipelineGroups:
    """This rank's process groups (module docstring); every rank creates all of them."""

    chain: Any            # the lead chain of this rank's pipeline (None for a follower)
    dp: Any               # this (stage, position) across pipelines
    tp: Any               # this (stage, pipeline); None at width 1
    pipeline: Any         # every rank of this pipeline


def make_groups(groups: PlanGroups, rank: int) -> PipelineGroups:
    """This rank's groups, made in the plan's ``groups`` (every rank makes each replica's chain,
    every (stage, position)'s replica group and, with tensor-parallel stages, every stage's
    tensor-parallel groups and each replica's whole ranks; without, those are its chain)."""
    layout = groups.layout
    place = layout.where(rank)
    stage, pipe, pos = place.stages[0], place.replica, place.position
    groups.make("chain", "replica")
    if layout.tensor_parallel:
        groups.make("tensor", "whole_replica")
    return PipelineGroups(chain=groups.chain(pipe) if pos == 0 else None, dp=groups.replica(stage, pos),
                          tp=groups.tensor(stage, pipe) if layout.widths[stage] > 1 else None,
                          pipeline=groups.whole_replica(pipe) if layout.tensor_parallel else groups.chain(pipe))


class StageLink:
    """The lead's messages to its followers over the stage's tensor-parallel group: each message's
    header (what the follower runs next) on a host group (:func:`fxpar.runtime.distributed.host_group`:
    a host tensor, read without waiting for the device), its tensors on the stage's group."""

    def __init__(self, group: Any, lead: int, device: torch.device) -> None:
        self.group, self.lead, self.device = group, lead, device
        self.control = host_group(group)

    def _header(self, op: int | None = None) -> int:
        h = host_tensor([op or 0])
        dist.broadcast(h, src=self.lead, group=self.control)
        return int(h.tolist()[0])

    def send(self, op: int, tensors: Sequence[torch.Tensor] = ()) -> None:
        self._header(op)
        for t in tensors:
            dist.broadcast(t.detach().contiguous(), src=self.lead, group=self.group)

    def receive_header(self) -> int:
        return self._header()

    def receive(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in like:
            buf = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            dist.broadcast(buf, src=self.lead, group=self.group)
            out.append(buf)
        return out


class LeadExit(torch.autograd.Function):
    """Identity on the lead's stage outputs that need gradients; its backward (the start of the
    micro-batch's stage backward) sends ``BWD`` and the output gradients to the followers, starts
    the emulation clock of the backward and stops it where that backward ends (a schedule runs
    one backward per stage and micro-batch: ``torch.autograd.backward`` from the stage's outputs
    to its parameters and inputs).  The end was once "every parameter has its gradient", by a
    multi-gradient hook that held each gradient until the last, so that autograd copied every
    one into its parameter (:func:`fxpar.compat.end_of_backward`)."""

    @staticmethod
    def forward(ctx, link: StageLink | None, clock: SegmentClock, *outs: torch.Tensor):
        ctx.link, ctx.clock = link, clock
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.link is not None:
            ctx.link.send(BWD, grads)
        ctx.clock.start()
        end_of_backward(ctx.clock.stop)   # the stage's backward ends with the backward it runs in
        return (None, None, *grads)


def wrap_stage(module: torch.nn.Module, clock: SegmentClock, link: StageLink | None,
               on_forward: Callable[[Sequence[Any]], None] | None = None) -> None:
    """Replace ``module.forward`` so that it tells the followers (``link``: a tensor-parallel
    stage's lead), times the compute with the emulation ``clock``, and marks the outputs so the
    backward does both too (:class:`LeadExit`);
    ``on_forward`` sees the outputs the schedule gets (the replica sum counts forwards)."""
    inner = module.forward

    def forward(*args):
        grad = torch.is_grad_enabled()
        if link is not None:
            link.send(FWD if grad else FWD_NOGRAD, [a for a in args if isinstance(a, torch.Tensor)])
        clock.start()
        out = inner(*args)
        clock.stop()
        outs = out if isinstance(out, tuple) else (out,)
        keep = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        # always marked, at full speed too: the clock's busy time (what adapting reads a rank's
        # speed from) must cover the backward at every speed, or a rank slowed to 0.3 looked 0.12
        if grad and keep:
            marked = iter(LeadExit.apply(link, clock, *(outs[i] for i in keep)))
            outs = tuple(next(marked) if i in keep else o for i, o in enumerate(outs))
            out = outs if isinstance(out, tuple) else outs[0]
        if on_forward is not None:
            on_forward(outs)
        return out

    module.forward = forward




def follow(link: StageLink, forward: Any, inputs_like: Sequence[torch.Tensor], clock: SegmentClock,
           on_forward: Callable[[Sequence[Any]], None] | None = None) -> None:
    """A follower's side of one schedule run (module docstring): replay the lead's forwards and
    backwards until ``DONE`` (``on_forward``: as :func:`wrap_stage`'s)."""
    pending: deque[list[torch.Tensor]] = deque()
    while True:
        op = link.receive_header()
        if op == DONE:
            break
        if op in (FWD, FWD_NOGRAD):
            grad = op == FWD
            received = link.receive(inputs_like)
            args = [r.requires_grad_(ex.requires_grad and grad and r.is_floating_point())
                    for r, ex in zip(received, inputs_like)]
            with torch.set_grad_enabled(grad):
                clock.start()
                out = forward(*args)
                clock.stop()
            if grad:
                outs = out if isinstance(out, tuple) else (out,)
                pending.append([o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad])
                if on_forward is not None:
                    on_forward(outs)
        elif op == BWD:
            if not pending:
                raise PlanError("pipeline stage follower: a backward arrived before its forward")
            outs = pending.popleft()
            grads = link.receive(outs)
            clock.start()
            torch.autograd.backward(outs, grads)
            clock.stop()
        else:
            raise PlanError(f"pipeline stage follower: unknown message {op} from the lead")
    if pending:
        raise PlanError(f"pipeline stage follower: {len(pending)} forwards had no backward")
