"""The adaptive module's next switch: the plan it goes to, what kind of switch it is, and the
preparation of its module on a thread (:mod:`fxpar.adapt.module`, 6).

A switch is *due* at a step boundary when its module is built there (no preparation), when it
was asked for at once (``switch_to(plan)``), or when every rank's preparation was done at a
records gather (each rank's :meth:`PendingSwitch.done_flag` rides in its gathered rows, so every
rank reads the same flags and the switch is due at the same step on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpar.adapt.prepare import Prepared, Preparation
from fxpar.plan import Plan


@dataclass(eq=False)
class PendingSwitch:
    """The next switch (``plan`` None: none) and where its module is being built."""

    plan: Plan | None = None
    kind: str = "switch"                      # or "rollback"
    preparation: Preparation | None = None    # its module being built on a thread
    due_now: bool = False                     # due at the next step boundary, waiting for the build
    since: int = 0                            # the step it was set at
    prepared_everywhere: bool = False         # every rank's build done, as read at a gather
    #: the running plan's step measured when the switch was decided, before the re-plan and the
    #: preparation slowed its steps: the rollback's baseline (:mod:`fxpar.adapt.module`, 5)
    measured_before_s: float | None = None
    #: the decision's step for ``plan``, re-priced by the running plan's error (None: a
    #: ``switch_to`` or a rollback, priced by no decision): what the switch expects to measure
    expected_step_s: float | None = None

    @property
    def due(self) -> bool:
        """Whether the switch runs at the next step boundary (module docstring)."""
        return self.plan is not None and (self.preparation is None or self.due_now or self.prepared_everywhere)

    def serve(self) -> None:
        """Run the exports its preparation handed to this, the training, thread (between steps:
        :mod:`fxpar.adapt.prepare`, "Exports on the training thread")."""
        if self.preparation is not None:
            self.preparation.serve()

    def done_flag(self) -> float:
        """This rank's flag for the records gather: 1.0 once its preparation is done."""
        return float(self.preparation is not None and self.preparation.done())

    def read_flags(self, flags: Sequence[float]) -> None:
        """Every rank's :meth:`done_flag` as gathered."""
        if self.preparation is not None and all(f == 1.0 for f in flags):
            self.prepared_everywhere = True

    def take(self) -> Prepared | None:
        """The prepared module (waiting for its thread), or None where it is built at the switch."""
        preparation, self.preparation = self.preparation, None
        return preparation.result() if preparation is not None else None

    def give_back(self) -> None:
        """Release what a preparation that will not be switched to built (its thread waited for)."""
        if self.preparation is not None:
            self.preparation.discard()
            self.preparation = None
