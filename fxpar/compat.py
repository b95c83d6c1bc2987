"""The one place fxpar touches private torch names, each with why.

- ``torch.distributed.pipelining.schedules._Action`` / ``_ComputationType``: a schedule with
  several stages per rank in *uneven* numbers (a fast rank holding more stages) is expressed,
  as torch's own interleaved schedules do, as a per-rank list of actions given to the public
  ``PipelineScheduleMulti`` runtime; torch has no public constructor for those actions.
- ``PipelineScheduleMulti._validate_and_set_stage_mapping``: derives and checks the stage ->
  rank mapping from such an action list (what torch's ``_PipelineScheduleRuntime`` does
  after loading a schedule); torch's public schedules only place stages ``i -> i mod ranks``.

Checked against torch 2.13; a torch without them raises a clear error when an interleaved plan
is run, and nothing else in fxpar depends on them.
"""

from __future__ import annotations

from typing import Any

from fxpar.errors import RuntimeSetupError


def pipeline_action(stage: int, kind: str, microbatch: int) -> Any:
    """A forward (``"F"``) or full backward (``"B"``) of ``microbatch`` on ``stage``."""
    try:
        from torch.distributed.pipelining.schedules import _Action, _ComputationType
    except ImportError as exc:  # pragma: no cover - other torch versions
        raise RuntimeSetupError(f"interleaved pipeline schedules need torch's pipelining actions ({exc}); "
                                "use a 1F1B or GPipe plan with this torch") from None
    computation = _ComputationType.FORWARD if kind == "F" else _ComputationType.FULL_BACKWARD
    return _Action(stage, computation, microbatch)


def set_stage_mapping(schedule: Any, actions: dict[int, list[Any]]) -> None:
    """Let a ``PipelineScheduleMulti`` derive (and validate) its stage -> rank mapping from
    ``actions``."""
    setter = getattr(schedule, "_validate_and_set_stage_mapping", None)
    if setter is None:  # pragma: no cover - other torch versions
        raise RuntimeSetupError("this torch's PipelineScheduleMulti cannot take a custom stage placement; "
                                "use a 1F1B or GPipe plan")
    setter(actions)
