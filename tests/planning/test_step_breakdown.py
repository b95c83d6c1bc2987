"""``python -m benchmarks.step_breakdown`` (where a step's time goes, measured and priced, per op
class) runs on the CPU as it runs on a GPU: every profiled aten op lands in a class the tracer
knows (a backward in its forward's, the optimizer apart), and every class the roofline prices
or the profiler measured has its row."""

from __future__ import annotations

import pytest

from benchmarks.step_breakdown import main, op_class_of, render
from fxpar.tracing.graph import OpClass

CLASSES = {c.value for c in OpClass} | {"optimizer"}


@pytest.mark.parametrize("aten,expected", [
    ("aten::addmm", "matmul"), ("aten::_log_softmax_backward_data", "norm"), ("aten::nll_loss_forward", "loss"),
    ("aten::embedding_dense_backward", "embedding"), ("aten::_scaled_dot_product_flash_attention", "attention"),
    ("aten::_scaled_dot_product_efficient_attention_backward", "attention"), ("aten::_fused_adamw_", "optimizer"),
    ("aten::gelu_backward", "elementwise"), ("aten::_flash_attention_forward", "attention"),
    ("aten::_efficient_attention_backward", "attention"), ("aten::_cudnn_attention_forward", "attention")])
def test_a_profiled_op_lands_in_its_forwards_class(aten, expected):
    assert op_class_of(aten) == expected


@pytest.mark.full   # a calibration, a trace and two profiled steps of a tiny GPT-2 (about 7 s)
def test_the_cpu_run_measures_and_prices_every_class(tmp_path):
    result = main(["--device", "cpu", "--model", "gpt2", "--warmup", "1", "--json", str(tmp_path / "b.json")])
    measured, priced = result["measured"]["classes"], result["priced"]
    assert set(measured) <= CLASSES and set(priced) == {"catalog", "calibrated"}
    for p in priced.values():
        assert set(p) <= CLASSES and p["matmul"] > 0 and p["optimizer"] > 0
    assert "matmul" in measured and result["measured"]["busy_s"] == pytest.approx(sum(measured.values()))
    table = render(result)
    assert all(name in table for name in set(measured) | set(priced["catalog"]))
    assert (tmp_path / "b.json").is_file()
    rates = result["calibration"]   # each calibrated figure beside the catalog's, as a ratio
    assert {"matmul fp32 FLOP/s", "memory B/s", "AdamW s/param"} <= set(rates)
    assert all(v["of_catalog"] == pytest.approx(v["measured"] / v["catalog"]) for v in rates.values())


def test_the_table_is_the_measured_and_priced_seconds_it_is_given():
    """Rendered from injected figures (no clock): each class's row, priced over measured."""
    result = {"label": "injected", "measured": {"classes": {"matmul": 0.004, "elementwise": 0.002},
                                                 "busy_s": 0.006, "wall_s": 0.008},
              "priced": {"catalog": {"matmul": 0.002, "elementwise": 0.003, "optimizer": 0.001}}}
    table = render(result)
    assert "matmul      | 4.00" in table and "2.00 (0.50)" in table and "3.00 (1.50)" in table
    assert "optimizer" in table and "6.00 (1.00)" in table and "6.00 (0.75)" in table
