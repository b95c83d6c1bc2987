"""Simulator: predicted step time, per-device timeline, utilization and peak memory of a Plan."""

from fxpar.sim.simulate import simulate
from fxpar.sim.timeline import SimResult, TimelineEvent, micro_batch_sizes

__all__ = ["SimResult", "TimelineEvent", "micro_batch_sizes", "simulate"]
