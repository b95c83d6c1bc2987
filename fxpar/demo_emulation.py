"""The emulation of ``fxpar demo``'s torch baselines (DDP, FSDP2): :class:`HookClock` and the
public torch hooks that drive it, so a slow rank of a baseline sleeps as an fxpar rank of the same
speed does.  The rules (what is a compute segment, which hooks mark which collective) are in
:mod:`fxpar.demo`'s docstring; :func:`fxpar.demo.baseline_steps` times the wrapped models.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fxpar.runtime.emulation import SpeedEmulator
from fxpar.tracing.structure import block_path


# ---- emulation of the baselines ----------------------------------------------------------------
class HookClock:
    """:class:`~fxpar.runtime.emulation.SegmentClock`'s rule for collectives that torch issues
    itself: :meth:`before_collective` stretches the compute since the last mark (``(1/s − 1)``
    times it) and marks; :meth:`after_collective` marks, so the collective's own time is never
    stretched.  Outside :meth:`start` ... :meth:`stop` (set-up, the optimizer) nothing is."""

    def __init__(self, emulator: SpeedEmulator) -> None:
        self.emulator = emulator
        self.active = False
        self.compute_s = self.emulation_s = self.comm_s = self.cpu_s = 0.0
        self.collectives = 0
        self._mark = self._mark_cpu = 0.0
        self._comm_from: float | None = None

    def start(self) -> None:
        self.active = True
        self.compute_s = self.emulation_s = self.comm_s = self.cpu_s = 0.0
        self.collectives = 0
        self._comm_from = None
        self._mark, self._mark_cpu = time.perf_counter(), time.thread_time()

    def before_collective(self) -> None:
        if not self.active:
            return
        # stretched by its CPU time, as SegmentClock does (fxpar.runtime.emulation's docstring);
        # the CPU clock read first, so its interval lies inside the wall interval
        cpu = time.thread_time() - self._mark_cpu
        seg = time.perf_counter() - self._mark
        self.compute_s += seg
        self.cpu_s += cpu
        self.emulation_s += self.emulator.stretch(cpu)
        self.collectives += 1
        self._comm_from = self._mark = time.perf_counter()
        self._mark_cpu = time.thread_time()

    def after_collective(self) -> None:
        if not self.active:
            return
        now = time.perf_counter()
        if self._comm_from is not None:
            self.comm_s += now - self._comm_from
            self._comm_from = None
        self._mark, self._mark_cpu = now, time.thread_time()

    def stop(self) -> None:
        """End of the step's backward: what ran since the last collective began is waiting on
        it (DDP's and FSDP2's final waits run inside ``backward()``), so nothing more is
        stretched."""
        self.after_collective()
        self.active = False

    def timing(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "emulation_s": self.emulation_s, "comm_s": self.comm_s,
                "cpu_s": self.cpu_s, "collectives": float(self.collectives)}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tensor, tuple / list, dict / ModelOutput)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def wrap_ddp(model: torch.nn.Module, clock: HookClock) -> torch.nn.Module:
    """torch DDP (even split), emulated per compute segment (:mod:`fxpar.demo`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    # compute starts with the wrapped module's forward (DDP's buffer broadcast is before it)
    model.register_forward_pre_hook(lambda module, args: clock.after_collective())

    def stretched_allreduce(process_group, bucket):  # unannotated: DDP checks the annotations
        clock.before_collective()
        fut = allreduce_hook(process_group, bucket)  # DDP's own math: divide by world, all-reduce
        clock.after_collective()
        return fut

    ddp.register_comm_hook(None, stretched_allreduce)
    return ddp


def wrap_fsdp2(model: torch.nn.Module, clock: HookClock) -> torch.nn.Module:
    """torch FSDP2: ``fully_shard`` on every repeated block, then on the root (even shards),
    emulated per compute segment (:mod:`fxpar.demo`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = {b for b in (block_path(n) for n, _ in model.named_modules()) if b}
    sharded = [m for n, m in model.named_modules() if n in blocks]
    for module in sharded:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in [*sharded, model]:  # registered after FSDP's own hooks (see _bracket_fsdp)
        _bracket_fsdp(module, clock)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        def after_embedding_backward(module: Any, args: Any, out: Any) -> None:
            for t in _tensors(out):
                if t.grad_fn is not None:  # the last compute before FSDP's final reduce-scatter
                    t.grad_fn.register_hook(lambda grad_inputs, grad_outputs: clock.before_collective())
        embeddings.register_forward_hook(after_embedding_backward)
    return model


def _bracket_fsdp(module: torch.nn.Module, clock: HookClock) -> None:
    """Hooks before and after each of FSDP2's collectives on ``module``: its pre-forward
    all-gather, its pre-backward all-gather (hooks on the outputs) and its post-backward
    reduce-scatter (hooks on the autograd node FSDP puts on the inputs)."""
    def before_forward(mod: Any, args: Any, kwargs: Any) -> None:
        clock.before_collective()

    def after_forward_gather(mod: Any, args: Any, kwargs: Any) -> None:
        clock.after_collective()
        if not torch.is_grad_enabled():
            return
        nodes = {id(t.grad_fn): t.grad_fn for t in (*_tensors(args), *_tensors(kwargs))
                 if t.requires_grad and t.grad_fn is not None}
        for node in nodes.values():  # FSDP's post-backward function: the reduce-scatter
            node.register_prehook(lambda grad_outputs: clock.before_collective())
            node.register_hook(lambda grad_inputs, grad_outputs: clock.after_collective())

    def before_backward_gather(mod: Any, args: Any, out: Any) -> None:
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(lambda grad: clock.before_collective())

    def after_backward_gather(mod: Any, args: Any, out: Any) -> None:
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(lambda grad: clock.after_collective())

    module.register_forward_pre_hook(before_forward, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(after_forward_gather, with_kwargs=True)
    module.register_forward_hook(before_backward_gather, prepend=True)
    module.register_forward_hook(after_backward_gather)
