"""``examples/train_trainer.py`` under ``adapt:`` with every rank's busy time *injected* (run by
torchrun from tests/multirank/test_integrations.py).

The test checks that the adaptive module reacts to what it measures, not to how this machine's
timing came out: each rank reports ``predicted_busy_s · planned speed / speed``, what a device of
its current emulated speed takes for its part of the current plan (the example's ``--slow-down`` callback
changes the speed mid-run), through :attr:`fxpar.adapt.AdaptiveModule.measure_busy`. Its step's
wall time is injected the same way (:attr:`~fxpar.adapt.AdaptiveModule.measure_wall`), so the
rollback check after a switch compares the two plans' modeled steps (the slowest rank's busy
time), not one step of this machine's wall clock: a loaded CI machine once measured the new
plan's first step slower than the old one's and rolled the switch back.
Everything else is the example, unchanged.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from trainer_injected_busy import load_example  # a sibling script: torchrun puts its folder on sys.path


def modeled_busy(pmodel):
    """``step -> seconds`` for this rank: the current plan's prediction at its emulated speed.
    The plan predicts at the speed it was made for (``RankPlan.speed``: a re-plan's includes the
    measured slow-down), so the prediction scales by planned / current speed."""
    rank = dist.get_rank()

    def busy(step: int) -> float:
        planned = pmodel.plan.ranks[rank]
        return planned.predicted_busy_s * planned.speed / pmodel.emulator.speed
    return busy


def main() -> None:
    example = load_example()

    class InjectedBusyCallback(example.FxparCallback):
        def attach(self, pmodel, max_microbatches=None):
            super().attach(pmodel, max_microbatches)
            pmodel.measure_busy = modeled_busy(pmodel)
            pmodel.measure_wall = lambda step, plan: pmodel.measure_busy(step)   # the max over ranks: the slowest

        @property
        def events(self):
            return getattr(self.monitor.pmodel, "events", [])

    example.FxparCallback = InjectedBusyCallback  # what the example's main() instantiates
    example.main()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
