"""A GPU's calibration measures its kernels, not their launches: the matrix-product rate of every
precision the GPU has and its memory bandwidth reach a third of the catalog's peak for its type
(an H200 measured 39 TFLOP/s of bf16 on CPU-sized products, 4 % of its peak, and priced GPT-2's
step 4.4x slow; the CPU test of the sizes is
``tests/planning/test_calibration.py::test_a_gpus_rates_are_timed_on_problems_that_outlast_their_launch``)."""

from __future__ import annotations

import pytest
import torch

from fxpar.calibrate.measure import low_precisions, matmul_rate, memory_rate, optimizer_costs, softmax_elements_rate
from fxpar.cluster.catalog import CATALOG
from fxpar.profiling.local_cache import local_gpu_type
from fxpar.profiling.roofline import optimizer_key

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")]
#: the least fraction of a catalog peak a product or a copy of GPU-sized operands reaches
LEAST_FRACTION = 1 / 3


def test_a_gpus_calibrated_rates_reach_a_third_of_its_catalog_peak():
    name = local_gpu_type()
    if name is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in the catalog: no peak to compare with")
    gpu, device = CATALOG[name], torch.device("cuda")
    for dtype, torch_dtype in low_precisions(device):
        if dtype not in gpu.supported_dtypes():
            continue
        rate = matmul_rate(device, torch_dtype)
        assert rate >= LEAST_FRACTION * gpu.peak_tflops(dtype) * 1e12 * gpu.matmul_efficiency, (dtype, rate)
    # a GPU's 2-byte products with an odd dimension are timed too (their rate is the price of a
    # 50257-word head); what fraction of the aligned rate they reach is the GPU's to say
    for dtype, torch_dtype in low_precisions(device):
        if torch_dtype.itemsize == 2 and dtype in gpu.supported_dtypes():
            assert matmul_rate(device, torch_dtype, unaligned=True) > 0
    memory = memory_rate(device)
    assert memory >= LEAST_FRACTION * gpu.memory_gbps * 1e9, memory
    # a pass of the loss reads its logits and writes as many: no slower than a third of that traffic
    assert softmax_elements_rate(device) >= LEAST_FRACTION * gpu.memory_gbps * 1e9 / 8
    # AdamW moves 28 bytes a parameter: its fitted seconds per parameter are at least a third of
    # that traffic's at the catalog bandwidth (a launch-bound fit finds 0)
    adam = optimizer_costs(device)[optimizer_key("adamw", "fp32")]
    assert adam.fwd[1] >= LEAST_FRACTION * 28.0 / (gpu.memory_gbps * 1e9), adam
