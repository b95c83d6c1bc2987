"""``examples/train_trainer.py`` with the step monitor's busy times *injected* (run by torchrun
from tests/multirank/test_integrations.py).

The re-balancing test checks that the callback reacts to what it measures, not how this
machine's timing came out: each rank reports ``share × SECONDS_PER_SAMPLE / speed``, what a
device of its current emulated speed would take for its share (the ``--slow-down`` callback
changes the speed mid-run as before), through :attr:`fxpar.integrations.monitor.StepMonitor.
measure_busy`.  Everything else is the example, unchanged.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_trainer.py"
SECONDS_PER_SAMPLE = 0.01


def modeled_busy(pmodel):
    """``step -> seconds`` for this rank: its share at its current emulated speed."""
    def busy(step: int) -> float:
        share = pmodel.plan.ranks[pmodel.rank].batch_share
        return share * SECONDS_PER_SAMPLE / pmodel.emulator.speed
    return busy


def load_example():
    """``examples/train_trainer.py`` as a module: a test replaces its ``FxparCallback`` (what its
    ``main()`` instantiates) before running ``main()``."""
    spec = importlib.util.spec_from_file_location("train_trainer_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def main() -> None:
    example = load_example()

    class InjectedBusyCallback(example.FxparCallback):
        def attach(self, pmodel, max_microbatches=None):
            super().attach(pmodel, max_microbatches)
            self.monitor.measure_busy = modeled_busy(pmodel)

    example.FxparCallback = InjectedBusyCallback  # what the example's main() instantiates
    example.main()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
