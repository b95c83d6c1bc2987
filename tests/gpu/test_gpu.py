"""Parity on CUDA with the ``nccl`` backend (2 GPUs): data parallelism and a 2-stage pipeline,
loss and every gradient vs one process on the same GPU.  Written to run unchanged on a 2-GPU
machine; skipped here (no CUDA) with the reason."""

from __future__ import annotations

import pytest
import torch

from fxpar.runtime import WorkerPool

from .workers_gpu import gpu_parity

pytestmark = [pytest.mark.gpu, pytest.mark.multirank,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA devices (this machine has {torch.cuda.device_count()})")]
TOLERANCE = 1e-4  # fp32 on GPU: TF32 is off by default for matmuls in torch; reductions reorder


@pytest.fixture(scope="module")
def nccl_pool():
    with WorkerPool(2, backend="nccl", env={"TRANSFORMERS_VERBOSITY": "error"}) as pool:
        yield pool


@pytest.mark.parametrize("kind", ["data_parallel", "pipeline"])
def test_parity_on_cuda_with_nccl(nccl_pool, kind: str) -> None:
    results = nccl_pool.run(gpu_parity, kind)
    for r in results:
        assert r["device"] == f"cuda:{r['rank']}"
        assert r["form"] == kind
        for s in r["steps"]:
            assert s["loss_diff"] < TOLERANCE and s["max_grad_abs_diff"] < TOLERANCE, r
