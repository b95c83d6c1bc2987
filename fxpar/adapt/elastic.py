"""Lost and new ranks: background checkpoints, and resuming re-planned for another world size.

Under elastic ``torchrun`` (``--nnodes=MIN:MAX --max-restarts=N``) a lost node makes the
survivors' collectives fail (the process group's timeout, or a closed connection), torchrun
restarts the workers of the nodes left, and each new worker runs the script again: it plans for
the devices it has now (``Cluster.detect()``), builds its module, and :func:`resume` loads the
newest complete checkpoint into it — a checkpoint written under any plan and world size loads
into any other (:mod:`fxpar.checkpoint`).  A rejoining or spare node is the same restart with
more ranks (``MAX`` nodes).  The batch of step ``s`` must depend on ``s`` only (the example's
data does), so the sample stream goes on from the checkpoint's step.

**What is lost** is the steps since the last checkpoint: at most ``every`` steps (and the one in
flight).  :class:`BackgroundCheckpointer` keeps that bound cheap to make small: every ``every``
steps it *stages* this rank's pieces (parameters and optimizer state) to host memory on the
training thread — the only part the step waits for — and writes them on a background thread.
The write's collectives (the DCP plan exchange and the atomic rename) run on a process group of
their own, created once (gloo, so they never share a communicator with training's collectives);
a save still running when the next one is due, or at :meth:`close`, is joined first, so no
collective is left un-joined at exit.  A rank killed mid-write leaves a ``.partial`` folder,
which :func:`~fxpar.checkpoint.latest_checkpoint` skips.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpar.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fxpar.checkpoint.layout import DescribedModule, Layout, LocalParam, describe, is_distributed
from fxpar.errors import ConfigError
from fxpar.runtime.device import HOST
from fxpar.runtime.distributed import new_group


def _stage(pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any) -> tuple[DescribedModule, Any]:
    """Host copies of this rank's parameters and optimizer state, and an optimizer-shaped holder."""
    layout = describe(pmodel)
    copies = {id(lp.param): lp.param.detach().to(HOST, copy=True) for lp in layout.params}
    params = [LocalParam(fqn=lp.fqn, param=copies[id(lp.param)], shard=lp.shard, write=lp.write)
              for lp in layout.params]
    held = type(type(optimizer).__name__, (), {})()  # the class name is what the checkpoint records
    held.param_groups = [dict(g, params=[copies[id(p)] for p in g["params"] if id(p) in copies])
                         for g in optimizer.param_groups]
    held.state = {copies[id(p)]: {k: v.detach().to(HOST, copy=True) if isinstance(v, torch.Tensor) else v
                                  for k, v in st.items()}
                  for p, st in optimizer.state.items() if id(p) in copies}
    staged = Layout(kind=layout.kind, params=tuple(params), group=group, distributed=is_distributed(group))
    return DescribedModule(staged), held


class BackgroundCheckpointer:
    """Every ``every`` steps, a checkpoint of ``pmodel`` and ``optimizer`` under ``root``
    (``step-NNNNNN``), written in the background (module docstring).  Collective: every rank
    creates it, and calls :meth:`maybe_save` after each optimizer step and :meth:`close` at the end."""

    def __init__(self, pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str | Path, *,
                 every: int, keep: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"BackgroundCheckpointer: every = {every!r}; expected an int >= 1 (steps between "
                              "checkpoints: at most that many steps are lost with a rank)")
        self.pmodel, self.optimizer, self.root, self.every, self.keep = pmodel, optimizer, Path(root), every, keep
        distributed = dist.is_available() and dist.is_initialized()
        # its own gloo group, with the job's collective timeout (runtime.distributed.new_group)
        self.group = new_group(backend="gloo") if distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stage_s: list[float] = []   # what each save cost the training thread
        self.saved: list[int] = []

    def maybe_save(self, step: int) -> bool:
        """After the optimizer step of ``step`` (1-based count of steps done): save if due."""
        if step % self.every:
            return False
        self.wait()
        start = time.perf_counter()
        staged, held = _stage(self.pmodel, self.optimizer, self.group)
        self.stage_s.append(time.perf_counter() - start)
        self._thread = threading.Thread(target=self._write, args=(staged, held, step), daemon=False,
                                        name=f"fxpar-checkpoint-{step}")
        self._thread.start()
        return True

    def _write(self, staged: DescribedModule, held: Any, step: int) -> None:
        try:
            save_checkpoint(staged, held, self.root / f"step-{step:06d}", step=step,
                            distributed=self.group is not None)
            self.saved.append(step)
            if self.group is None or dist.get_rank(self.group) == 0:
                self._prune()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by wait()
            self._error = exc

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints this checkpointer wrote."""
        for step in self.saved[:-self.keep]:
            shutil.rmtree(self.root / f"step-{step:06d}", ignore_errors=True)
        self.saved = self.saved[-self.keep:]

    def wait(self) -> None:
        """Join a save in flight; raise its error here, on the training thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the last save (call before the process group is destroyed)."""
        self.wait()


def resume(pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer | None, root: str | Path) -> dict[str, Any]:
    """Load the newest complete checkpoint under ``root`` (any plan, any world size) into
    ``pmodel`` / ``optimizer``; what was found: ``step`` (0: none), ``saved_by``,
    ``saved_world_size``, ``world_size`` now, ``resume_s``.  Collective."""
    start = time.perf_counter()
    found = latest_checkpoint(root)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if found is None:
        return {"step": 0, "saved_by": None, "saved_world_size": None, "world_size": world, "resume_s": 0.0}
    meta = load_checkpoint(pmodel, optimizer, found)   # an adaptive module: its plan's (describe)
    return {"step": int(meta.step or 0), "saved_by": meta.saved_by, "saved_world_size": meta.world_size,
            "world_size": world, "path": str(found), "resume_s": time.perf_counter() - start}
