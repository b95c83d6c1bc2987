"""No host sync in a steady step (issue #36 item 2), proved on the CPU by counting.

A step that reads a device value on the host (``item``, ``int``, ``float``, ``bool``,
``__index__``, ``tolist``), sizes an output by data (mask indexing, ``nonzero``,
``repeat_interleave`` without ``output_size``, ``bincount``, ``unique``) or calls ``synchronize``
stalls a GPU rank's host until the device catches up.  :class:`fxpar.runtime.step_audit.StepAudit`
counts each of them during the third step of every plan family on gloo ranks (the first steps'
one-off work -- the cast probe, building buckets -- is done by then) and attributes each to
fxpar's code or to the model's own (transformers' mask code makes one read per forward that the
plain model makes too).  fxpar's count must be zero, but for the device-to-host copies the
runtime declares (:func:`fxpar.runtime.device.host_copy`): one per MoE layer and micro-batch
(expert parallelism's routing counts) and one per fp16 step (the loss-scale verdict, as
``GradScaler`` has).  The same on a GPU is ``tests/gpu/test_gpu_one.py``'s sync-debug test.
"""

from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch

import fxpar.runtime.device as device
import fxpar.runtime.step_audit as step_audit
from fxpar.runtime.step_audit import CUDA_SYNC_WARNING, StepAudit

from .workers_audit import pipeline_ops_beyond_plain, step_cost_of_kind


def test_the_audit_sees_every_kind_of_read() -> None:
    t = torch.tensor([1, 2, 3])
    with StepAudit() as cost:
        t[0].item(), int(t[1]), float(t[2]), bool(t[0]), t.tolist(), [0, 1, 2, 3][t[1]]
        t[t > 1], torch.repeat_interleave(t, t), torch.nonzero(t), torch.bincount(t)
        torch.repeat_interleave(t, t, output_size=6)               # sized on the host: fine
        copied = device.host_copy(t)                                # a declared device-to-host copy
        copied.tolist(), device.host_tensor([4, 5]).tolist()        # host tensors: free to read
    # made here, outside the fxpar package: counted as the model's own (what a plain loop makes)
    assert len(cost.model_reads) == 6 and not cost.host_reads, cost.model_reads
    assert len(cost.model_dynamic_shapes) == 4 and not cost.dynamic_shapes, cost.model_dynamic_shapes
    assert all("test_step_audit.py" in r for r in cost.model_reads + cost.model_dynamic_shapes)
    assert cost.d2h_copies == 1
    assert cost.ops > 10 and cost.op_counts["aten._local_scalar_dense.default"] == 5


def _stack_from(filename: str, source: str = "result = traceback.extract_stack()") -> dict:
    """What ``source`` leaves behind when run as if it were the file ``filename``."""
    scope = {"traceback": traceback, "warnings": warnings, "CUDA_SYNC_WARNING": CUDA_SYNC_WARNING}
    exec(compile(source, filename, "exec"), scope)
    return scope


def test_a_cause_is_told_by_the_packages_folders_not_by_a_folder_name() -> None:
    """The GPU machine's venv is ``/opt/torch/.venv``: transformers' files there hold ``/torch/``
    in their path and were taken for torch's (the 2026-12-04 H200 run), so a read in its mask
    code was blamed on the caller.  A frame is torch's when it lies in torch's folder, fxpar's
    when it lies in fxpar's."""
    venv = os.path.join(os.sep, "opt", "torch", ".venv", "lib", "site-packages")
    masking = _stack_from(os.path.join(venv, "transformers", "masking_utils.py"))["result"]
    assert step_audit.attribute(masking) == (False, "transformers/masking_utils.py:1 <module>")
    ours = _stack_from(os.path.join(step_audit._FXPAR_FOLDER, "runtime", "a_step.py"))["result"]
    assert step_audit.attribute(ours) == (True, "runtime/a_step.py:1 <module>")
    beneath = _stack_from(os.path.join(step_audit._TORCH_FOLDER, "nn", "an_op.py"))["result"]
    assert step_audit.attribute(beneath)[1].startswith("multirank/test_step_audit.py:")  # torch's frame skipped
    inside_a_checkout_named_fxpar = os.path.join(os.sep, "home", "fxpar", "tests", "a_test.py")
    assert step_audit.attribute(_stack_from(inside_a_checkout_named_fxpar)["result"])[0] is False


def test_cuda_syncs_are_recorded_each_time_with_their_cause() -> None:
    """``StepAudit(cuda_syncs=True)`` takes each of torch's sync-debug warnings (raised here as a
    plain warning: no CUDA on this machine) as a CUDA sync of fxpar's or of the model's, every
    occurrence, and passes other warnings on; on leaving, warnings are as they were."""
    warn = f"warnings.warn('{CUDA_SYNC_WARNING}')"
    shown = warnings.showwarning
    with StepAudit(cuda_syncs=True) as cost:
        for _ in range(2):
            _stack_from(os.path.join(step_audit._FXPAR_FOLDER, "runtime", "a_step.py"), warn)
        _stack_from(os.path.join(os.sep, "site-packages", "transformers", "masking_utils.py"), warn)
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else")
    assert cost.cuda_syncs == ["CUDA sync at runtime/a_step.py:1 <module>"] * 2, cost.cuda_syncs
    assert cost.model_cuda_syncs == ["CUDA sync at transformers/masking_utils.py:1 <module>"]
    assert warnings.showwarning is shown and cost.summary()["cuda_syncs"] == 2


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_gpu_sync_tests_batches_make_the_plain_model_read_nothing(family: str) -> None:
    """transformers' mask code reads a device value on the host in every forward of a batch
    without an attention mask (its packed-sequence check), in the plain model too; the batch the
    GPU sync-debug test feeds (an attention mask of ones, as a tokenizer gives) makes the plain
    model read nothing, so what that test catches is fxpar's."""
    from tests.gpu.workers_gpu import masked_batch
    from tests.workers import global_batch, tiny_model

    model = tiny_model(family)
    bare = global_batch(model, 4, 32)
    with StepAudit() as without_mask:
        model(**bare).loss.backward()
    with StepAudit() as with_mask:
        model(**masked_batch(bare)).loss.backward()
    assert [r for r in without_mask.model_reads if "masking_utils" in r], without_mask.model_reads
    assert not with_mask.model_reads and not with_mask.host_reads and not with_mask.model_dynamic_shapes


def _check(results: list[dict], copies_per_rank) -> None:
    for r in results:
        c = r["cost"]
        assert c["host_reads"] == 0 and c["dynamic_shapes"] == 0 and c["syncs"] == 0, (r["module"], c)
        assert c["d2h_copies"] == copies_per_rank(r), (r["module"], c)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["data_parallel", "sharded_data_parallel",
                                  pytest.param("tensor_parallel", marks=pytest.mark.full),
                                  pytest.param("pipeline", marks=pytest.mark.full)])
def test_no_host_read_in_a_steady_step(pool2, kind: str) -> None:
    _check(pool2.run(step_cost_of_kind, kind), lambda r: 0)


@pytest.mark.multirank
def test_expert_parallelism_reads_its_routing_once_per_layer_and_micro_batch(pool2) -> None:
    _check(pool2.run(step_cost_of_kind, "expert_parallel"), lambda r: r["moe_layers"] * r["microbatches"])


@pytest.mark.multirank
@pytest.mark.full
@pytest.mark.parametrize("kind,dtype,stage", [("sharded_data_parallel", "fp32", 2), ("sharded_data_parallel", "bf16", 3),
                                              ("interleaved", "fp32", 3), ("data_parallel", "fp16", 3)])
def test_no_host_read_more_plans(pool2, kind: str, dtype: str, stage: int) -> None:
    _check(pool2.run(step_cost_of_kind, kind, 3, dtype, stage), lambda r: 1 if dtype == "fp16" else 0)


@pytest.mark.multirank
@pytest.mark.full
def test_no_host_read_pipeline_tp(pool3) -> None:
    _check(pool3.run(step_cost_of_kind, "pipeline_tp"), lambda r: 0)


def _beyond_plain(results: list[dict]) -> tuple[int, dict]:
    """Ops both stages dispatched in a step beyond the plain model's, in total and by op."""
    extra: dict[str, int] = {}
    for r in results:
        for op, n in r["ops"].items():
            extra[op] = extra.get(op, 0) + n
    plain = next(r for r in results if "plain_ops" in r)["plain_ops"]
    for op, n in plain.items():
        extra[op] = extra.get(op, 0) - n
    return sum(extra.values()), extra


@pytest.mark.multirank
@pytest.mark.full
def test_a_pipeline_step_adds_no_op_per_layer_or_parameter_to_the_model(pool2) -> None:
    """A 2-stage SDPA GPT-2 against the plain model in the same two micro-batches, at 2 and 4
    blocks (28 and 52 parameters).  Measured 2026-12-04: 93 ops more at either depth; before the
    causal-mask pass and the end-of-backward callback (``tests/graph/test_graph_passes.py``), 222
    and 258 -- each gradient copied into its parameter, each forward building the mask."""
    (shallow, by_op), (deep, _) = (_beyond_plain(pool2.run(pipeline_ops_beyond_plain, n)) for n in (2, 4))
    assert deep == shallow, (shallow, deep)
    assert by_op.get("aten.new_empty_strided.default", 0) <= 0, by_op   # no gradient copied
    assert by_op.get("aten._scaled_dot_product_attention_math.default", 0) <= 0, by_op   # no masked attention
    assert by_op.get("aten._local_scalar_dense.default", 0) <= 0, by_op   # no host read the plain model does not make

