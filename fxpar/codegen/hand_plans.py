"""Moved: the hand-written plans are :mod:`fxpar.forms.hand_plans` (each form's builders live in its
folder).  This module still gives its old names until fxpar 0.3, with a ``FutureWarning``."""

from __future__ import annotations

from fxpar.forms.hand_plans import block_paths, expert_parallel_plan, interleaved_plan, pipeline_plan, tensor_parallel_plan
from fxpar.renamed import warn_module_moved

__all__ = ["block_paths", "expert_parallel_plan", "interleaved_plan", "pipeline_plan", "tensor_parallel_plan"]

warn_module_moved(__name__, "fxpar.forms.hand_plans")
