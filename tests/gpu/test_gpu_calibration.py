"""A GPU's calibration has every figure the GPU pricing reads: a matrix-product rate per
precision the GPU runs, the rate of its 2-byte products with a dimension that is not a multiple
of 8, memory and softmax rates, and the three optimizer implementations' fits.  How they compare
with the catalog's peaks is measured, not asserted: ``python -m benchmarks.step_breakdown``
prints each as a fraction of it (an H200 measured 39 TFLOP/s of bf16 on CPU-sized products, 4 %
of its peak, before its problems were sized for it; the CPU test of the sizes is
``tests/planning/test_calibration.py::test_a_gpus_rates_are_timed_on_problems_that_outlast_their_launch``)."""

from __future__ import annotations

import pytest
import torch

from fxpar.calibrate.measure import measure_device
from fxpar.profiling.roofline import optimizer_key

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")]


def test_a_gpus_calibration_has_every_figure_its_pricing_reads():
    figures = measure_device(torch.device("cuda"))
    assert set(figures["matmul"]) == {"fp32", "bf16", "fp16"} and min(figures["matmul"].values()) > 0
    assert set(figures["matmul_unaligned"]) == {"bf16", "fp16"} and min(figures["matmul_unaligned"].values()) > 0
    assert figures["memory"] > 0 and figures["softmax"] > 0 and figures["overhead"] > 0
    for name in ("adamw", "fused_adamw", "sgd"):
        assert optimizer_key(name, "fp32") in figures["ops"]
