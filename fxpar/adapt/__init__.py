"""Training that adapts while it runs: measure per-rank speeds, re-plan any form from the
cached trace, and move the live parameters and optimizer state to the new layout in memory.

Modules, lowest first: ``speeds`` (the emulation's speed timeline, the detector), ``decide``
(re-plan and the switch rule), ``switch`` (build the new plan's module on ``meta``, reshard,
swap the optimizer's parameters; a :class:`~fxpar.adapt.prepare.Preparation` builds on a thread),
``pending`` (the next switch and its preparation), ``settings`` (:class:`Adapt`, what a user sets), ``module`` (:class:`AdaptiveModule`, what
``fxpar.auto(..., adapt=True)`` returns).  It sits beside :mod:`fxpar.api`, below it: the API
imports it, never the other way.
"""

from fxpar.adapt.decide import AdaptPolicy, Decision
from fxpar.adapt.module import AdaptiveModule
from fxpar.adapt.replan import Planning
from fxpar.adapt.settings import Adapt
from fxpar.adapt.speeds import DetectorSettings, SpeedDetector, SpeedTimeline

__all__ = ["Adapt", "AdaptPolicy", "AdaptiveModule", "Decision", "DetectorSettings", "Planning", "SpeedDetector",
           "SpeedTimeline"]
