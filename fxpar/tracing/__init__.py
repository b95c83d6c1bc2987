"""Tracing: ``torch.export`` turns a model into a :class:`ModelGraph` with per-node costs."""

from fxpar.tracing.graph import (
    LayerInfo,
    ModelGraph,
    OpClass,
    OpNode,
    ParamInfo,
    WorkloadSummary,
)
from fxpar.tracing.trace import trace

__all__ = ["LayerInfo", "ModelGraph", "OpClass", "OpNode", "ParamInfo", "WorkloadSummary", "trace"]
