"""A plan's dtype policy (:mod:`fxpar.dtype_policy`) and what the sharded runtime sends under it.

- The policy is plain data in the plan: JSON round trip, defaults from the plan's dtype, clear
  errors for a value that cannot be.
- ``cast="autocast"``: a bf16 sharded plan gathers in bf16 exactly the parameters autocast casts,
  so one process of it equals one process of the model under autocast *bit for bit*: the loss and
  every gradient, on the first step (gathered in fp32 while the probe watches) and the next (in
  bf16).
- ``cast="all"`` (FSDP2's semantics): equals, bit for bit, one process of the model whose
  parameters are cast to bf16, under the same autocast.
- On 2 gloo ranks (batch 3:1, state 1:3), the same plans against one process by the
  mixed-precision rules of ``tests/parity.py`` (``AUTOCAST_*``: the ranks' matmuls cut the batch
  differently, so bf16 rounds other values); the all-gathers carry the bytes the policy says and
  the reduce-scatters the reduce dtype.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxpar
from fxpar.codegen.common.module import RankModule
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.dtype_policy import DtypePolicy
from fxpar.errors import PlanError
from fxpar.plan import Plan
from tests.multirank import workers_sharded as w
from tests.parity import AUTOCAST_GRAD_RTOL, AUTOCAST_LOSS_RTOL, check_gradients, check_loss, expect


def _plan(stage: int, cast: str, world: int = 1, **policy) -> Plan:
    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0] * world), batch_split=[4] * world,
                                      state_split=[1] * world, shard_stage=stage, dtype="bf16")
    return dataclasses.replace(plan, dtype_policy=DtypePolicy(param_dtype="bf16", cast=cast, **policy))


def test_policy_is_plan_data() -> None:
    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0, 1.0]), batch_split=[2, 2],
                                      state_split=[1, 1], dtype="bf16")
    assert plan.dtype_policy is None and plan.precision == DtypePolicy(param_dtype="bf16")
    assert Plan.from_json(plan.to_json()) == plan                      # the default stays implicit
    assert '"param_dtype": "bf16"' in plan.to_json()                   # ... and is written in full
    mine = dataclasses.replace(plan, dtype_policy=DtypePolicy(param_dtype="bf16", reduce_dtype="bf16", cast="all"))
    back = Plan.from_json(mine.to_json())
    assert back == mine and back.precision.reduce_dtype == "bf16" and back.precision.cast == "all"
    assert dataclasses.replace(plan, dtype="fp32").precision.param_dtype == "fp32"   # follows the dtype
    with pytest.raises(PlanError, match="param_dtype = 'bf16' but the plan trains in 'fp32'"):
        dataclasses.replace(plan, dtype="fp32", dtype_policy=DtypePolicy(param_dtype="bf16"))
    with pytest.raises(PlanError, match="cast = 'some'"):
        DtypePolicy(cast="some")
    with pytest.raises(PlanError, match="master_dtype"):
        DtypePolicy(master_dtype="bf16")
    with pytest.raises(PlanError, match="unknown keys"):
        Plan.from_dict({**plan.to_dict(), "dtype_policy": {"param": "bf16"}})


def _one_process(family: str, stage: int, cast: str) -> list[tuple[float, float, float]]:
    model = w.tiny_model(family)
    reference = copy.deepcopy(model)
    if cast == "all":
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
    data = w.global_batch(model, 4, 12, seed=3)
    pm = RankModule(model, _plan(stage, cast), 0, emulate=False)
    out = []
    for _ in range(2):   # the probe's step (fp32 gathers), then the bf16 gathers
        loss = pm.step(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = reference(**data, use_cache=False).loss
        ref.float().backward()
        grads = {t.names[0]: t.shard.grad for t in pm.form.tensors}
        worst = max((grads[n].float() - p.grad.float()).abs().max().item() for n, p in reference.named_parameters())
        out.append((float(loss), float(ref.detach()), worst))
        for p in [*reference.parameters(), *pm.parameters()]:
            p.grad = None
    wire = {t.names[0]: u.train.wire[i] for u in pm.form._units for i, t in enumerate(u.tensors)}
    return out, wire


@pytest.mark.parametrize("stage", [2, 3])
def test_autocast_cast_rule_is_bit_exact(stage: int) -> None:
    steps, wire = _one_process("llama", stage, "autocast")
    for loss, ref, worst in steps:
        assert loss == ref and worst == 0.0, steps
    # the matmul weights travel in bf16; embeddings and norms in fp32
    assert wire["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert wire["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16
    assert wire["model.embed_tokens.weight"] == torch.float32
    assert wire["model.norm.weight"] == wire["model.layers.0.input_layernorm.weight"] == torch.float32


def test_autocast_cast_rule_keeps_a_tied_embedding() -> None:
    """GPT-2's lm_head is its embedding: read by F.embedding as well as cast for the head's matmul,
    it stays fp32; the Conv1D weights and biases (addmm) go bf16."""
    steps, wire = _one_process("gpt2", 3, "autocast")
    assert all(loss == ref and worst == 0.0 for loss, ref, worst in steps), steps
    assert wire["transformer.wte.weight"] == torch.float32
    assert wire["transformer.h.0.attn.c_attn.weight"] == wire["transformer.h.0.attn.c_attn.bias"] == torch.bfloat16


def test_all_cast_rule_equals_bf16_parameters() -> None:
    steps, wire = _one_process("gpt2", 3, "all")
    assert all(loss == ref and worst == 0.0 for loss, ref, worst in steps), steps
    assert set(wire.values()) == {torch.bfloat16}


CASES = {
    "zero3 autocast": (3, "autocast", "fp32"),
    "zero2 autocast": (2, "autocast", "fp32"),
    "zero3 all, bf16 reduce": (3, "all", "bf16"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "zero3 autocast" else pytest.mark.full)
                                  for c in CASES])
def test_two_ranks_bf16(pool2, case: str) -> None:
    stage, cast, reduce = CASES[case]
    results = pool2.run(w.bf16_parity, "llama", stage, cast, reduce)
    for r in results:
        for k, s in enumerate(r["steps"]):
            expect(check_loss(s["loss"], s["ref_loss"], AUTOCAST_LOSS_RTOL),
                   check_gradients(s["grads"], AUTOCAST_GRAD_RTOL), context=(case, r["rank"], k))
            assert s["reduce_dtypes"] == ['float32' if reduce == 'fp32' else 'bfloat16'], s
        first, second = r["steps"]
        assert "bfloat16" in second["wire"]
        if cast == "autocast":   # the probe's step gathers fp32; then the cast parameters go bf16
            assert second["gather_bytes"] < 0.75 * first["gather_bytes"] and r["part_ratio"] < 0.8, r
        else:                    # FSDP2's rule: everything bf16 from the first step (16-byte alignment aside)
            assert first["gather_bytes"] == second["gather_bytes"] and r["part_ratio"] <= 0.51, r
