"""The base of every form's module: :class:`~fxpar.runtime.contract.ParallelModuleBase` and the
members that need the checkpoint layer above the runtime (``save_pretrained``).

A form's module derives from :class:`FormModule` first and, where the step loop runs it, from
:class:`~fxpar.runtime.step_loop.StepModule` after it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fxpar.checkpoint.hf_save import save_pretrained as save_sharded
from fxpar.runtime.contract import ParallelModuleBase


class FormModule(ParallelModuleBase):
    """What every form's module shares above the runtime (module docstring)."""

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """A HF ``save_pretrained`` folder of the whole model written from the ranks' own pieces
        (their ``checkpoint_layout()``): each tensor written by one rank, assembled from the
        others' boxes where it is sharded, tied weights once, no rank building the model
        (:mod:`fxpar.checkpoint.hf_save`; ``max_shard_size`` accepted).  Collective."""
        with self._saving():
            save_sharded(self, self.original_model, output_dir, **kwargs)

    def _saving(self) -> contextlib.AbstractContextManager[Any]:
        """A context around :meth:`save_pretrained` (a form whose layout moves for the save)."""
        return contextlib.nullcontext()
