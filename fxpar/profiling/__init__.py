"""Profiling: what each node costs on each device type, and each collective on each link."""

from fxpar.profiling.roofline import CostModel, SampleCost

__all__ = ["CostModel", "SampleCost"]
