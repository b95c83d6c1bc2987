"""Plans written by hand: every form's builders, gathered from the forms' folders (each builder
lives beside its form's other phases, in ``fxpar/forms/<folder>/apply_plans.py``).  A builder
returns the same :class:`~fxpar.plan.Plan` the planner emits, from a few choices, for tests,
experiments and users who know what they want; pass it as ``fxpar.auto(model, cluster,
plan=...)`` or write it with ``Plan.to_json``.

=========================================  ==================================================
builder                                    plan
=========================================  ==================================================
:func:`pipeline_plan`                      stages of whole blocks, per-stage tensor parallelism,
                                           expert splits, pipelines (1F1B or GPipe)
:func:`interleaved_plan`                   an interleaved pipeline (a rank holds several stages)
:func:`tensor_parallel_plan`               uneven tensor parallelism, replicas data parallel
:func:`expert_parallel_plan`               uneven expert parallelism, the rest data parallel
:func:`sharded_data_parallel_plan`         ZeRO-2/3 with batch and state shares of their own
=========================================  ==================================================

(``fxpar.codegen.hand_plans`` and ``fxpar.codegen.sharded_plans``, their place before, still give
them until fxpar 0.3, with a ``FutureWarning``.)
"""

from __future__ import annotations

from fxpar.forms.expert.apply_plans import expert_parallel_module, expert_parallel_plan
from fxpar.forms.pipeline.apply_plans import interleaved_plan, pipeline_plan
from fxpar.forms.sharded.apply_plans import sharded_data_parallel_plan
from fxpar.forms.tensor.apply_plans import tensor_parallel_plan
from fxpar.tracing.structure import block_paths

__all__ = ["block_paths", "expert_parallel_module", "expert_parallel_plan", "interleaved_plan", "pipeline_plan",
           "sharded_data_parallel_plan", "tensor_parallel_plan"]
