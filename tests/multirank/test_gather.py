"""``gather_gradients``: one implementation (:class:`fxpar.codegen.common.module.FormModule`), on
the layout checkpoints use, so every form gives the whole model's gradients on one rank -- whole
and sharded tensors, tied weights under each name -- equal to one process's by the gradient
rule of ``tests/parity.py``."""

from __future__ import annotations

import pytest

from ..parity import check_gradients, expect
from .workers_gather import gathered_gradients

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("kind", ["data_parallel", "sharded_data_parallel", "pipeline", "tensor_parallel",
                                  "expert_parallel"])
def test_every_form_gathers_the_whole_models_gradients(pool2, kind: str) -> None:
    results = {r["rank"]: r for r in pool2.run(gathered_gradients, kind)}
    assert results[1]["none"], "rank 1 is not dst: it gets None"
    r = results[0]
    assert r["names"] == r["ref_names"] and r["shapes"], (kind, set(r["names"]) ^ set(r["ref_names"]))
    assert kind in ("tensor_parallel", "expert_parallel") or len(r["tied"]) == 2, r["tied"]
    expect(check_gradients(r["grads"]), context=kind)
