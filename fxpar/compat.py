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

- ``torch.distributed.pipelining.stage._RootArgPlaceholder`` / ``_RecvInfo`` and a stage's
  ``bwd_cache`` / ``args_recv_info``: torch 2.11's stages refuse a received input that gets no
  gradient; :func:`pipeline_stage_class` recognises that release by the first name and sends
  zeros for such an input (torch >= 2.13 needs none of it).

- ``torch.ops.aten._assert_tensor_metadata``: ``torch.export`` puts one before every
  ``aten.to`` of the graph (torch 2.11 and 2.13: its ``_insert_aten_to_metadata_assert_pass``),
  asserting the dtype, device and layout the input had while tracing.  Autocast changes those
  dtypes at run time (a bf16 matmul output where the export saw float32), so pipeline stages
  drop these nodes (:func:`is_tensor_metadata_assert`); the op is private, and there is no
  public switch to export without it.
- ``torch.ops.higher_order.wrap_with_autocast`` and its argument layout ``(device_type, dtype,
  enabled, cache_enabled, body, *operands)``: how the export records a ``with torch.autocast``
  block of the model's forward (transformers' float32 rotary tables).  The device type is a
  literal of the export; a stage exported on the host and run on a GPU must name the GPU's
  (:func:`retarget_autocast_region`).  The name is public, the layout is torch's own
  (``torch._higher_order_ops.wrap.WrapWithAutocast``).
- ``torch.SymInt.node.expr`` (and ``SymFloat``/``SymBool``'s): the sympy expression behind a
  symbolic value of an export made with a symbolic batch size
  (:class:`fxpar.codegen.stages.export.ExportCache`).  A value one pipeline piece makes and a
  later one reads is given to the stages as a constant (the split); for such an export it is
  evaluated at the example's sizes (:func:`symbolic_at`).  torch has no public way to evaluate a
  symbolic value at given sizes outside its shape environment.
- ``torch.fx._lazy_graph_module._use_lazy_graph_module``: graph modules made inside it write and
  compile their Python code only when first run or read (what ``torch.compile`` uses).  A
  pipeline split makes one graph module per stage and their parent, and a rank runs only its
  own stage, whose code it then changes twice (device constants, ``histc``): compiled eagerly,
  that was 7 code generations per switch, about a third of its build
  (:func:`lazy_graph_modules`).  Without the name (another torch) the modules compile eagerly.

transformers (checked against 5.23):

- ``PreTrainedModel._keys_to_ignore_on_save``: ``Trainer`` reads it from the model it trains
  when it resumes from a checkpoint (the warning after loading weights).  fxpar's parallel
  module is a plain ``nn.Module`` standing in for the user's model, so it must carry the
  attribute; transformers has no public way to declare it (:func:`set_keys_to_ignore_on_save`).
- ``experts._is_expert_parallel``: HF's fused experts implementations skip the routed slots of
  experts held elsewhere (the sentinel index) only when this flag is set, as transformers' own
  expert-parallel sharding sets it; there is no public setter (:func:`mark_expert_parallel`).
- ``type(experts)._apply_gate``: how an experts class combines its gate and up projections;
  fxpar's expert parallelism supports only the default ``act(gate) * up``, and the method's
  name is the only way to tell a custom gate (:func:`expert_gate_is_default`).
- ``config._attn_implementation``: the attention implementation a model was built with
  (``"sdpa"``, ``"eager"``, ...), after ``from_config`` resolved it (a class that cannot use
  SDPA falls back to eager, :func:`fxpar.tracing.hf.build_model`); transformers exposes it
  only under this name (:func:`attn_implementation`).
- ``config._experts_implementation``: how fused experts run (``"grouped_mm"``, ``"eager"``,
  ...; checked against 5.25, absent on LongCat-Flash's experts in 5.17); ``grouped_mm`` needs
  16-byte rows, so tensor parallelism refuses splits that are not
  (:func:`fxpar.codegen.tensor.families._expert_columns`); only under this name
  (:func:`experts_implementation`).

- ``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a mode that sees every
  aten op a forward dispatches (torch's own ``FlopCounterMode`` is one); fxpar records a model
  that does not export by running it under such a mode (:mod:`fxpar.tracing.recorded`,
  :func:`dispatch_recorder_base`).  torch documents the mode (``__torch_dispatch__``) but keeps
  the class in a private module; checked against torch 2.11 and 2.13.

- ``torch.ops.aten._to_copy``: the op autocast's casts dispatch to (``Tensor.to`` is a composite
  of it).  A bf16 / fp16 sharded plan watches its first forward for which parameters are only
  ever cast to the low precision (:mod:`fxpar.forms.sharded.apply_probe`, :func:`is_dtype_cast`);
  aten has no public name for the op (checked against torch 2.11 and 2.13).  The same mode
  base class (:func:`dispatch_recorder_base`) runs the probe and the step audit's counters
  (:mod:`fxpar.runtime.host_reads`).

- ``torch._dynamo.utils.counters`` and ``torch._dynamo.exc.TorchDynamoException``: how many graph
  breaks and graphs ``torch.compile`` made (a plan's compiled regions list their breaks and a
  test checks that nothing recompiles after the second step: :mod:`fxpar.runtime.compile`), and
  whether an error came from compiling (a region that cannot compile is named in a ConfigError).
  torch has no public counter or base class for either (checked against torch 2.11 and 2.13).

- ``torch._subclasses.fake_tensor.FakeTensorMode``: runs ops on tensors that have a device and
  shapes but no values.  A bf16 / fp16 pipeline of a meta model needs its stage boundaries'
  shapes and dtypes *under the host's autocast* (the meta device has none), without computing
  or holding the model: the pass runs on unwritten host stand-ins under this mode
  (:func:`fake_host_mode`).  ``torch.export`` uses the same class; it has no public name
  (checked against torch 2.11 and 2.13).

- ``torch.profiler.profile().profiler.kineto_results.events()`` and its events' ``name()``,
  ``shapes()`` and ``dtypes()``: the profiler's raw records.  torch 2.13's public events carry
  their inputs' dtypes (``FunctionEvent.input_dtypes``); torch 2.11's do not, and without the
  dtype a collective's bytes are not known (a bf16 all-reduce or a packed uint8 all-gather read
  as fp32 is counted 2x or 4x: :func:`fxpar.profiling.wire_bytes.collective_events`).  Read only
  where the public events lack the field (:func:`profiled_ops`).

- ``torch.autograd.Variable._execution_engine.queue_callback``: run a function when the running
  backward ends.  A pipeline stage's emulation clock stops there (:func:`end_of_backward`);
  the public alternative, ``register_multi_grad_hook(params, mode="all")``, keeps every
  parameter's gradient until the last arrives, so autograd cannot hand a gradient to its
  parameter and copies each one (measured: one ``new_empty_strided`` + ``copy_`` per parameter
  per micro-batch).  torch's FSDP2 and DDP queue their end-of-backward work the same way
  (checked against torch 2.11 and 2.15).

The private names are reached through these functions only (``tests/project/test_private_names.py``
scans the rest of the package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.errors import RuntimeSetupError

try:  # graph modules that compile when first run (lazy_graph_modules)
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
except ImportError:
    _use_lazy_graph_module = None


def pipeline_action(stage: int, kind: str, microbatch: int) -> Any:
    """A forward (``"F"``) or full backward (``"B"``) of ``microbatch`` on ``stage``."""
    try:
        from torch.distributed.pipelining.schedules import _Action, _ComputationType
    except ImportError as exc:  # pragma: no cover - other torch versions
        raise RuntimeSetupError(f"interleaved pipeline schedules need torch's pipelining actions ({exc}); "
                                "use a 1F1B or GPipe plan with this torch") from None
    computation = _ComputationType.FORWARD if kind == "F" else _ComputationType.FULL_BACKWARD
    return _Action(stage, computation, microbatch)


def set_stage_ranks(stage: Any, chain: list[int]) -> None:
    """Tell a torch ``PipelineStage`` which rank of its group runs each stage: stage ``j`` on the
    global rank ``chain[j]``.  torch assumes stage ``j`` is group rank ``j % group size``, and a
    group numbers its ranks in ascending global order (``new_group`` sorts them), so a chain
    that is not ascending (a placement putting stage 0 on rank 1) sends to the wrong peers and
    fails torch's p2p warm-up vote.  The mapping is the stage's ``stage_index_to_group_rank``
    attribute, which torch's multi-stage schedules set the same way; single-stage schedules
    (1F1B, GPipe) take no mapping, hence this setter."""
    order = sorted(chain)
    stage.stage_index_to_group_rank = {j: order.index(r) for j, r in enumerate(chain)}


def set_stage_mapping(schedule: Any, actions: dict[int, list[Any]]) -> None:
    """Let a ``PipelineScheduleMulti`` derive (and validate) its stage -> rank mapping from
    ``actions``."""
    setter = getattr(schedule, "_validate_and_set_stage_mapping", None)
    if setter is None:  # pragma: no cover - other torch versions
        raise RuntimeSetupError("this torch's PipelineScheduleMulti cannot take a custom stage placement; "
                                "use a 1F1B or GPipe plan")
    setter(actions)


# ---- torch.export graphs -------------------------------------------------------------------------
def is_tensor_metadata_assert(node: torch.fx.Node) -> bool:
    """True for an ``aten._assert_tensor_metadata`` node (any overload): an assertion of the dtype,
    device and layout a tensor had while the graph was exported."""
    if node.op != "call_function":
        return False
    packet = torch.ops.aten._assert_tensor_metadata
    return node.target is packet or any(node.target is getattr(packet, name) for name in packet.overloads())


def symbolic_expr(value: torch.SymInt) -> Any:
    """The sympy expression of a symbolic size (compared as a key by :func:`symbolic_at`)."""
    return value.node.expr


def symbolic_at(value: Any, sizes: dict[Any, int]) -> int | float | bool:
    """A symbolic int, float or bool evaluated with its symbols at ``sizes`` (keys:
    :func:`symbolic_expr` of the inputs' symbolic sizes); a TypeError where one is left."""
    cast = int if isinstance(value, torch.SymInt) else float if isinstance(value, torch.SymFloat) else bool
    return cast(value.node.expr.xreplace(sizes))


def lazy_graph_modules() -> Any:
    """A context in which new ``torch.fx`` graph modules compile their code only when first run
    or read (module docstring); a no-op where torch lacks the switch."""
    return contextlib.nullcontext() if _use_lazy_graph_module is None else _use_lazy_graph_module(True)


def retarget_autocast_region(node: torch.fx.Node, device_type: str) -> bool:
    """When ``node`` is an autocast region of an exported graph (``wrap_with_autocast``), make it
    act on ``device_type`` (its dtype, enabled flag and body are kept); True when it is one."""
    region = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    if region is None or node.op != "call_function" or node.target is not region:
        return False
    if node.args and node.args[0] != device_type:
        node.args = (device_type, *node.args[1:])
    return True


# ---- transformers ------------------------------------------------------------------------------
def set_keys_to_ignore_on_save(module: Any, keys: list[str] | None = None) -> None:
    """Give a module that stands in for a ``PreTrainedModel`` under ``Trainer`` the
    ``_keys_to_ignore_on_save`` attribute the Trainer reads on resume (None: none ignored)."""
    module._keys_to_ignore_on_save = keys


def mark_expert_parallel(experts: Any) -> None:
    """Tell an HF fused experts module that it holds only some experts: routed slots of the
    others (the sentinel index ``num_experts``) are skipped, as in transformers' own EP."""
    experts._is_expert_parallel = True


def expert_gate_is_default(experts_type: type) -> bool:
    """True when an HF experts class combines gate and up projections the default way
    (``act(gate) * up``; no ``_apply_gate`` of its own, or transformers' default one)."""
    gate_fn = getattr(experts_type, "_apply_gate", None)
    return gate_fn is None or getattr(gate_fn, "__name__", "") == "_default_apply_gate"


def attn_implementation(model: Any) -> str | None:
    """The attention implementation ``model`` (a HF ``PreTrainedModel``) runs, None for a
    model without a HF config."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None) if config is not None else None
    return str(value) if value is not None else None


def experts_implementation(experts: Any) -> str | None:
    """How the fused experts module ``experts`` runs (its HF config's choice), None where it
    has no such config (a class without transformers' experts dispatch)."""
    value = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return str(value) if value is not None else None


def pipeline_stage_class() -> type:
    """``torch.distributed.pipelining.PipelineStage``, or on torch releases whose stages refuse
    an input without a gradient (2.11: ``RuntimeError: [1] for chunk 0 has gradients None and is
    expecting to send gradients to stage 0``) a subclass that sends zeros for it.

    A stage input without a gradient is common: a value the previous stage computed without the
    parameters (a rotary table, an attention mask, integer positions) that only feeds
    non-differentiable paths.  torch >= 2.13 skips such a slot on both sides; 2.11 allocates a
    gradient buffer on the sending stage for every output it sent and requires a tensor for
    each, while its backward ignores the gradient of an output that needs none
    (``_backward.stage_backward`` keeps only outputs with a ``grad_fn``).  Zeros of the received
    buffer's shape and dtype satisfy the exchange and change no gradient.  The older design is
    recognised by its ``stage._RootArgPlaceholder`` class (gone in 2.13); the subclass reads the
    stage's private ``bwd_cache`` and ``args_recv_info`` (the gradients of a micro-batch and the
    received inputs they belong to), which is why it lives here."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import stage as stage_module

    if not hasattr(stage_module, "_RootArgPlaceholder"):
        return PipelineStage
    recv_info = stage_module._RecvInfo

    class ZeroGradInputsStage(PipelineStage):
        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
            grads = self.bwd_cache.get(bwd_chunk_id)
            if grads is not None and self.has_backward and not self.is_first:
                infos = self.args_recv_info[0]
                self.bwd_cache[bwd_chunk_id] = tuple(
                    g if g is not None or not isinstance(info, recv_info) else torch.zeros_like(info.buffer)
                    for g, info in zip(grads, infos))
            return super().get_bwd_send_ops(bwd_chunk_id)

    return ZeroGradInputsStage


def fake_host_mode() -> Any:
    """A ``FakeTensorMode`` that takes real tensors as inputs (module docstring)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_dtype_cast(func: Any) -> bool:
    """``func`` is ``aten._to_copy.default``: a cast (autocast's, ``Tensor.to``'s)."""
    return func is torch.ops.aten._to_copy.default


def dynamo_counters() -> Any:
    """dynamo's counters (``counters["graph_break"]``: breaks by reason; ``counters["stats"]``:
    ``unique_graphs``, ``calls_captured``)."""
    from torch._dynamo.utils import counters

    return counters


def is_compile_error(exc: BaseException) -> bool:
    """``exc`` (or what it wraps) was raised by torch.compile's tracing or a backend compiler."""
    from torch._dynamo.exc import TorchDynamoException

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TorchDynamoException):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def dispatch_recorder_base() -> type:
    """``TorchDispatchMode``, the base class of :mod:`fxpar.tracing.recorded`'s op recorder."""
    return TorchDispatchMode


def live_groups() -> list[Any]:
    """The process groups this process holds alive, the default one included.  torch has no
    public list (its group *counter* only grows); ``distributed_c10d._world.pg_map`` maps each
    live group to its backend and loses an entry at ``destroy_process_group``.  Read by
    :class:`fxpar.runtime.pool.WorkerPool` (a call's groups end with it) and leak checks."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def live_process_groups() -> int:
    """How many process groups this process holds alive (:func:`live_groups`)."""
    return len(live_groups())


def group_name_salt() -> int:
    """The number torch salts a hashed group name with in this process now
    (``distributed_c10d._hash_ranks_to_str``, used for a group its members make alone,
    ``new_group(..., use_local_synchronization=True)``): up to torch 2.13 how many groups the
    process has registered by name (``len(_world.pg_names)``, less on a member that destroyed
    some); from torch 2.15 ``_world.group_count``, which every group this process made advanced
    (and a group made by other ranks alone did not).  Read by probing the hash of ``[0]`` against
    both, so a third rule is an error here rather than a hang.  Members whose salts differ name
    the group differently and wait for each other until the timeout;
    :func:`fxpar.runtime.distributed.members_group` makes them agree.  No public accessor
    exists."""
    import hashlib

    from torch.distributed import distributed_c10d

    probe = distributed_c10d._hash_ranks_to_str([0])
    for salt in (int(distributed_c10d._world.group_count), len(distributed_c10d._world.pg_names)):
        if hashlib.sha1(f"0_{salt}".encode()).hexdigest() == probe:
            return salt
    raise RuntimeSetupError(f"torch {torch.__version__} names process groups by a rule fxpar does not "
                            "know (distributed_c10d._hash_ranks_to_str); fxpar.compat.group_name_salt "
                            "needs the new rule")


def local_group_name(ranks: list[int]) -> str:
    """The name torch would give, in this process now, a group over ``ranks`` made with
    ``use_local_synchronization=True`` (``distributed_c10d._hash_ranks_to_str``: a hash of the
    ranks salted by :func:`group_name_salt`).
    No public accessor exists; :func:`fxpar.runtime.distributed.members_group` compares it
    across the members before making the group."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._hash_ranks_to_str(list(ranks))


def profiled_ops(prof: Any) -> list[tuple[str, list[list[int]], list[str]]]:
    """``(name, input shapes, input dtype names)`` of every op a finished ``torch.profiler.profile``
    (``record_shapes=True``) recorded: from its public events where they carry dtypes (torch
    2.13), else from the profiler's raw records (torch 2.11; module docstring)."""
    events = list(prof.events())
    if not events or hasattr(events[0], "input_dtypes"):
        return [(e.name, [list(s) for s in (e.input_shapes or [])], list(getattr(e, "input_dtypes", None) or []))
                for e in events]
    return [(e.name(), [list(s) for s in e.shapes()], list(e.dtypes()))
            for e in prof.profiler.kineto_results.events()]


def end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward running now ends (module docstring).  Call it from
    inside a backward (an autograd function's ``backward``, a gradient hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
