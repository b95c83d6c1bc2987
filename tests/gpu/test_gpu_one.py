"""One GPU: every single-rank plan family (data parallel, sharded data parallel ZeRO-2/3, a
one-stage pipeline) in bf16 and fp16 against eager CUDA autocast on the same weights, so a
one-card machine checks something (``tests/gpu/test_gpu.py`` needs two).  The model is built on the
host as users do; fxpar moves it to ``cuda:0`` because the plan is for the local GPU kind.

Tolerances come from the half type's unit roundoff u (bf16 2^-8, fp16 2^-11): both sides run
the same autocast kernels on the same inputs, differing in the order of sums (gradient
accumulation, a pipeline stage's graph against eager modules), so the loss agrees to 4u
relative and the whole gradient to 8u of its norm (each tensor compared, the worst ratio
reported).  Skipped with the reason where CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch

from fxpar.runtime import WorkerPool

from .workers_gpu import UNIT_ROUNDOFF, one_gpu_family, sync_free_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")]
FAMILIES = [("data_parallel", None), ("sharded_data_parallel", 2), ("sharded_data_parallel", 3), ("pipeline", None)]


@pytest.fixture(scope="module")
def one_gpu_rank():
    """One NCCL rank in a process of its own (pipelines and sharded plans run on a group; the
    test process's own CUDA and process-group state stays out of it)."""
    with WorkerPool(1, backend="nccl", env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("family,stage", FAMILIES, ids=["dp", "zero2", "zero3", "pipeline"])
def test_one_gpu_family_matches_eager_autocast(one_gpu_rank, family: str, stage: int | None, dtype: str) -> None:
    [r] = one_gpu_rank.run(one_gpu_family, family, stage, dtype)
    u = UNIT_ROUNDOFF[dtype]
    assert r["form"] == family and r["grad_devices"] == ["cuda:0"], r
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=4 * u), r
    assert r["worst"] <= 8 * u, r


@pytest.mark.parametrize("family,stage", FAMILIES, ids=["dp", "zero2", "zero3", "pipeline"])
def test_a_steady_step_never_waits_for_the_gpu(one_gpu_rank, family: str, stage: int | None) -> None:
    """Issue #36 item 2 on the device: the third step of every one-GPU family in bf16 with torch's
    sync-debug mode on (host batches, as a DataLoader gives them) makes no synchronising CUDA
    operation, host read or data-dependent shape of fxpar's, and none of the model's that the
    plain model's step on the same batch does not make too (transformers 5.17's eager mask makes
    one); the CPU proof for every family and world size is ``tests/multirank/test_step_audit.py``."""
    [r] = one_gpu_rank.run(sync_free_steps, family, stage, "bf16")
    assert r["form"] == family and r["loss"] > 0, r
    assert len(r["control"]["model_cuda_syncs"]) == 1 and "workers_gpu.py" in r["control"]["model_cuda_syncs"][0], r
    ours = r["fxpar"]
    assert not ours["cuda_syncs"] and not ours["host_reads"] and not ours["dynamic_shapes"], ours
    assert not ours["syncs"], ours
    assert set(ours["model_cuda_syncs"]) <= set(r["plain"]["model_cuda_syncs"]), r
    assert set(ours["model_reads"]) <= set(r["plain"]["model_reads"]), r
