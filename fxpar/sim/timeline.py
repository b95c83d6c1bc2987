"""What every simulator returns: a step's per-rank timeline (:class:`TimelineEvent`) and its
figures (:class:`SimResult`); and the micro-batches a rank's share runs as
(:func:`micro_batch_sizes`).  Shared by the forms' ``price`` phases (:mod:`fxpar.forms.data.price`,
:mod:`fxpar.forms.expert.price`), :mod:`fxpar.sim.pipeline_plan` and :mod:`fxpar.sim.pipeline_sim`
(pipelines), which import it from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    rank: int
    kind: str            # "fwd", "bwd", "all_reduce", "idle", "optimizer"; pipelines: "hop" (waiting
    #                      for a transfer), "all_gather" (ZeRO-1); expert parallelism: "replicated",
    #                      "experts", "all_to_all"
    start_s: float
    end_s: float
    micro_batch: int = -1


@dataclass(frozen=True, slots=True)
class SimResult:
    step_s: float
    compute_s: float                       # the slowest rank's compute
    comm_s: float
    busy_s: tuple[float, ...]              # per rank: compute
    idle_s: tuple[float, ...]              # per rank: waiting for the slowest rank
    peak_memory_bytes: tuple[int, ...]     # per rank
    events: tuple[TimelineEvent, ...]
    #: per rank: the parameters and optimizer state it holds (``W + O`` of the peak formula,
    #: :func:`fxpar.profiling.memory.step_peak_bytes`), what a switch to this plan allocates
    #: on it beside the running plan's (:mod:`fxpar.adapt.decide`); empty where the form does not say
    state_bytes: tuple[int, ...] = ()

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(b / self.step_s if self.step_s > 0 else 0.0 for b in self.busy_s)


def micro_batch_sizes(share: int, size: int, count: int) -> list[int]:
    """The micro-batches codegen runs: ``count`` slices of ``size``, the last one shorter."""
    out, left = [], share
    for _ in range(count):
        m = min(size, left)
        if m > 0:
            out.append(m)
        left -= m
    return out
