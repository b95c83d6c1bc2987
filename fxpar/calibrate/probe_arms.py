"""What ``fxpar calibrate``'s runtime probe (:mod:`fxpar.calibrate.runtime_probe`, whose docstring
has the math) hands each form's ``calibrate`` phase: one of its probe models on the calibration's
group, and the name of the one overhead every form pays, whose arm is the probe's reference."""

from __future__ import annotations

from dataclasses import dataclass
import torch

from fxpar.cluster import Cluster
from fxpar.tracing.graph import ModelGraph

#: the step loop's own seconds per step, which every form pays once (a ProfileDB field,
#: :meth:`fxpar.profiling.CostModel.step_overhead_s`): the arm that measures it is the probe's
#: reference, measured against the plain loop, and every other arm is measured against it
STEP_OVERHEAD = "step_overhead_s"


@dataclass(frozen=True)
class ProbeModel:
    """One probe model on the calibration's group: the model, its traced graph and the global
    batch every arm steps (``samples_per_rank`` rows of ``seq_len`` tokens per rank)."""
    model: torch.nn.Module
    graph: ModelGraph               #: its traced graph
    batch: dict[str, torch.Tensor]
    cluster: Cluster                #: the group's devices, of the calibrated type
    samples_per_rank: int
    seq_len: int
    moe: bool                       #: a mixture-of-experts model (the dense one otherwise)

    @property
    def world(self) -> int:
        """The ranks of the group."""
        return self.cluster.world_size

    @property
    def global_batch(self) -> int:
        """The rows every arm's step trains on."""
        return self.samples_per_rank * self.world
