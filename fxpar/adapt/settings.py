"""What a user sets for adapting: :class:`Adapt` (``fxpar.auto(..., adapt=Adapt(...))``), made
of the switch rule's policy (:mod:`fxpar.adapt.decide`) and the detector's settings and the
emulation's timeline (:mod:`fxpar.adapt.speeds`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fxpar.adapt.decide import AdaptPolicy
from fxpar.adapt.speeds import DetectorSettings, SpeedTimeline
from fxpar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Adapt:
    """``fxpar.auto(..., adapt=Adapt(...))``: when and how to adapt (``adapt=True``: defaults)."""

    policy: AdaptPolicy = field(default_factory=AdaptPolicy)
    detector: DetectorSettings = field(default_factory=DetectorSettings)
    #: emulation only: per-rank speeds over the steps (:class:`SpeedTimeline`)
    timeline: SpeedTimeline | None = None
    #: steps the job runs (the default horizon of a switch's saving); None: unknown
    total_steps: int | None = None
    verbose: bool = True
    #: rank 0 re-plans while the ranks keep training (:class:`~fxpar.adapt.replan.DecisionInFlight`):
    #: ``"process"`` (or True) in the job's planning process (:mod:`fxpar.adapt.planning_process`;
    #: on a thread where it cannot start); ``"thread"`` on a thread; False: every rank waits for
    #: the decision at the step that detected the change
    background_planning: bool | str = "process"
    #: a switch's new module is built on a thread while the old plan trains, and the switch
    #: commits once every rank's is built (:mod:`fxpar.adapt.module`, 6), where that costs less
    #: than building at the switch (:func:`fxpar.adapt.prepare.background_pays`); False: always
    #: built at the switch
    prepare_in_background: bool = True

    def __post_init__(self) -> None:
        if self.background_planning not in (True, False, "process", "thread"):
            raise ConfigError(f"Adapt(background_planning={self.background_planning!r}): expected "
                              "'process', 'thread', True (= 'process') or False")

    @property
    def planning_mode(self) -> str | bool:
        """``"process"``, ``"thread"`` or False (:attr:`background_planning`, True read as ``"process"``)."""
        return "process" if self.background_planning is True else self.background_planning
