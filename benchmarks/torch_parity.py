"""fxpar's runtime against torch's own, card for card: the same model, batch and split on 2 gloo
CPU ranks (one core each, equal speeds: nothing is emulated), fp32 and bf16.

    python -m benchmarks.torch_parity [--rounds 3] [--steps 4] [--quick] [--dtypes fp32 bf16] [--out DIR]
    python -m benchmarks --suite torch_parity [--quick]

Pairs (fxpar arm / torch arm): uneven data parallelism at an even split / DDP; ZeRO-3 / FSDP2
(``fully_shard`` per block and root, ``reshard_after_forward=True``); ZeRO-2 / FSDP2 with
``reshard_after_forward=False``; tensor parallelism (key/value heads 2:2) / ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on every block's projections; a 2-stage pipeline (two
blocks a stage, :data:`MICRO` micro-batches, 1F1B) / torch's own pipelining front end on the same
cut (``pipeline()`` with a ``SplitPoint`` before block 2, its exported stages run by ``PipelineStage``
and ``Schedule1F1B``, the loss on the last stage); and data parallelism with
every block compiled (``torch.compile``, inductor, each block on its own as torchtitan's
``apply_compile``) / DDP over the same compiled blocks, beside the plain model compiled alike.  bf16: every arm under CPU
autocast; FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; fxpar's
ZeRO arms under their default policy (``cast="autocast"``: the parameters autocast casts gathered
in bf16) and also under ``cast="all"`` (FSDP2's rule).  fxpar's arms run the path uneven
plans take (its ragged layouts, at an even split).  A ``plain`` arm runs the model alone on each
rank's rows: what every other arm's extra ops and reads are counted against.

Each arm runs in fresh processes, the arms' order alternating from round to round; the other arm
of its pair is built and warmed beside it, torch's first, in every process of the pair, so the
two sides are timed in processes set up alike (what a process set up first -- its allocations,
imports, a device mesh -- shifts every later step in it by several percent, more than the
runtimes differ).  Per arm and rank: two warm-up steps (fxpar's
first step probes which parameters autocast casts), ``steps`` timed steps (forward, backward,
gradient sync, AdamW step; no instrumentation), then one step under each instrument:

- bytes: torch's profiler's backend events (``gloo:*``), converted by one formula per collective
  kind (:mod:`fxpar.profiling.wire_bytes`);
- host reads, data-dependent shapes, syncs and dispatched ops of the forward + backward + sync
  (:mod:`fxpar.runtime.step_audit`); an arm's extra ops are its ops minus the plain arm's (the
  compiled arms are not audited: dynamo runs no compiled graph under a dispatch mode);
- the tensor peak (:class:`fxpar.profiling.tensor_peak.TensorPeak`, one window).

Bytes are the most any rank sends (a pipeline's ranks send different things: activations
forward, gradients back).  A pipeline's ranks run half the model on every micro-batch, so the
plain arm is no baseline for their ops: the pipeline pair's "extra ops" are fxpar's ops less
torch's, summed over the ranks (torch's column reads ``base``).

Ratios are fxpar's median step over torch's in the same round; the table gives their median and
the range over the rounds.  Every figure is computed; this machine's timing is only compared
within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.common import finish
from fxpar.api import auto
from fxpar.cluster import Cluster
from fxpar.forms.hand_plans import pipeline_plan, tensor_parallel_plan
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.dtype_policy import DtypePolicy
from fxpar.plan import Plan
from fxpar.profiling.tensor_peak import TensorPeak, training_state
from fxpar.profiling.wire_bytes import collective_events, wire_bytes
from fxpar.runtime import WorkerPool
from fxpar.runtime.step_audit import StepAudit
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.tracing.structure import block_path

MODEL = ModelSpec(name="llama-parity", hf_config=dict(
    model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256))
BATCH, SEQ, WORLD = 8, 128, 2
MIB = 2 ** 20
#: fxpar arm -> its torch counterpart
PAIRS = {"fxpar DP": "torch DDP", "fxpar ZeRO-3": "torch FSDP2", "fxpar ZeRO-3 cast all": "torch FSDP2",
         "fxpar ZeRO-2": "torch FSDP2 no reshard", "fxpar ZeRO-2 cast all": "torch FSDP2 no reshard",
         "fxpar TP": "torch TP", "fxpar PP": "torch PP",
         "fxpar DP compiled": "torch DDP compiled"}
ARMS = ("plain", "torch DDP", "fxpar DP", "torch FSDP2", "fxpar ZeRO-3", "fxpar ZeRO-3 cast all",
        "torch FSDP2 no reshard", "fxpar ZeRO-2", "fxpar ZeRO-2 cast all", "torch TP", "fxpar TP", "torch PP", "fxpar PP", "plain compiled",
        "torch DDP compiled", "fxpar DP compiled")
#: the compiled arms' backend: inductor, each block compiled on its own (torchtitan's apply_compile)
BACKEND = "inductor"
WARMUP = 2
#: the pipeline pair's micro-batches (of BATCH // MICRO samples) and the blocks of its first stage
MICRO, CUT = 4, 2


# ---- the arms (inside the ranks) ---------------------------------------------------------------------
@dataclasses.dataclass
class Arm:
    """One arm on this rank: ``train(batch)`` runs forward, backward and the gradient sync,
    ``optimizer`` the step after it; ``resident`` what the rank holds between steps."""

    train: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    optimizer: torch.optim.Optimizer
    resident: Callable[[], list[torch.Tensor]]
    padding_bytes: int | None = None


def _autocast(dtype: str) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")


def _rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's half of the global batch (torch's even split)."""
    lo = dist.get_rank() * BATCH // WORLD
    return {k: v[lo:lo + BATCH // WORLD] for k, v in batch.items()}


def _plan(model: torch.nn.Module, dtype: str, arm: str) -> Plan:
    """The hand plan of fxpar arm ``arm`` (without " compiled")."""
    cluster = Cluster.emulated([1.0] * WORLD)
    if arm == "fxpar PP":
        return dataclasses.replace(pipeline_plan(model, cluster, global_batch=BATCH, num_microbatches=MICRO,
                                                 blocks_per_stage=[CUT, MODEL.hf_config["num_hidden_layers"] - CUT]),
                                   dtype=dtype)
    z = {stage: sharded_data_parallel_plan(cluster, batch_split=[BATCH // WORLD] * WORLD, state_split=[1] * WORLD,
                                           shard_stage=stage, model=MODEL.name, seq_len=SEQ, dtype=dtype)
         for stage in (2, 3)}
    dp = dataclasses.replace(z[3], form="data_parallel",
                             stages=(dataclasses.replace(z[3].stages[0], sharded=None),))
    tp = dataclasses.replace(tensor_parallel_plan(model, cluster, global_batch=BATCH, kv_shares=[2, 2]), dtype=dtype)
    every = {k: dataclasses.replace(z[k], dtype_policy=DtypePolicy(param_dtype="bf16", cast="all")) if dtype == "bf16"
             else z[k] for k in (2, 3)}
    return {"fxpar DP": dp, "fxpar ZeRO-3": z[3], "fxpar ZeRO-2": z[2], "fxpar TP": tp,
            "fxpar ZeRO-3 cast all": every[3], "fxpar ZeRO-2 cast all": every[2]}[arm]


def _fxpar(model: torch.nn.Module, plan: Plan, example: dict[str, torch.Tensor], compiled: bool) -> Arm:
    pm = auto(model, Cluster.emulated([1.0] * WORLD), example, plan=plan, emulate=False,
              compile=BACKEND if compiled else False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    units = getattr(pm.form, "_units", None)
    padding = sum(u.train.gather.layout.padding_bytes for u in units) // len(units) if units else None
    kept = lambda: [f for u in (units or []) for f in u.train.fulls]   # ZeRO-2 keeps its full tensors
    return Arm(train=pm.step, optimizer=opt, resident=lambda: training_state(pm, opt) + kept(), padding_bytes=padding)


def _torch(model: torch.nn.Module, arm: str, dtype: str) -> Arm:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    if arm.endswith("compiled"):   # each block on its own, the way fxpar's compiled arms are
        for path in {b for b in (block_path(n) for n, _ in model.named_modules()) if b}:
            block = model.get_submodule(path)
            block.forward = torch.compile(block.forward, backend=BACKEND, fullgraph=True)
    if arm.startswith("torch DDP"):
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif arm.startswith("torch FSDP2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" \
            else MixedPrecisionPolicy()
        reshard = arm == "torch FSDP2"
        blocks = {b for b in (block_path(n) for n, _ in model.named_modules()) if b}
        for name, module in model.named_modules():
            if name in blocks:
                fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        wrapped = fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    elif arm == "torch TP":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        wrapped = model
    else:
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    rows = (lambda b: b) if arm == "torch TP" else _rows

    def train(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with _autocast(dtype):
            loss = wrapped(**rows(batch), use_cache=False).loss
        loss.float().backward()
        return loss.detach()

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return Arm(train=train, optimizer=opt, resident=lambda: [local(t) for t in training_state(wrapped, opt)])


class _Logits(torch.nn.Module):
    """The model to its logits: what torch's pipelining front end splits (its schedule computes
    the loss from the last stage's output, the model's own loss function on each micro-batch)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _torch_pipeline(model: torch.nn.Module, dtype: str, example: dict[str, torch.Tensor]) -> Arm:
    """torch's own pipelining on the cut fxpar's pipeline arm makes (module docstring)."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    one = {"input_ids": example["input_ids"][: BATCH // MICRO]}
    try:
        pipe = pipeline(_Logits(model), mb_args=(), mb_kwargs=one,
                        split_spec={f"model.model.layers.{CUT}": SplitPoint.BEGINNING})
    except Exception as exc:   # torch 2.11's front end: "unexpected placeholder node" in its unflatten
        raise RuntimeError(f"torch {torch.__version__}'s pipeline() cannot split {MODEL.name} ({type(exc).__name__}: "
                           f"{str(exc)[:200]}); torch 2.15 can. Leave the pipeline pair out: --arms without "
                           "'torch PP' and 'fxpar PP'") from None
    stage = pipe.build_stage(dist.get_rank(), torch.device("cpu"))
    vocab = model.config.vocab_size
    loss = lambda logits, labels: model.loss_function(logits=logits, labels=labels, vocab_size=vocab)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=loss)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)
    last = dist.get_rank() == WORLD - 1

    def train(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with _autocast(dtype):
            if dist.get_rank() == 0:
                schedule.step(input_ids=batch["input_ids"], return_outputs=False)
            else:
                schedule.step(target=batch["labels"], losses=losses, return_outputs=False)
        return torch.stack(losses).mean().detach() if last else torch.zeros(())

    return Arm(train=train, optimizer=opt, resident=lambda: training_state(stage.submod, opt))


def _build(arm: str, dtype: str) -> tuple[Arm, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = build_model(MODEL, device="cpu", seed=0, attn_implementation="sdpa").train()
    batches = [example_inputs(model, BATCH, SEQ, seed=100 + i) for i in range(8)]
    for b in batches:
        b["labels"][0, : SEQ // 4] = -100
    if arm.startswith("fxpar"):
        plan = _plan(model, dtype, arm.removesuffix(" compiled"))
        return _fxpar(model, plan, batches[0], arm.endswith("compiled")), batches
    if arm == "torch PP":
        return _torch_pipeline(model, dtype, batches[0]), batches
    return _torch(model, arm, dtype), batches


def _step(arm: Arm, batch: dict[str, torch.Tensor]) -> None:
    arm.train(batch)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)


def partner(arm: str) -> str | None:
    """The arm built beside ``arm`` in its processes (its pair's other side), or None."""
    if arm in PAIRS:
        return PAIRS[arm]
    return next((mine for mine, theirs in PAIRS.items() if theirs == arm and "cast all" not in mine), None)


def arm_worker(arm_name: str, dtype: str, steps: int) -> dict[str, Any]:
    """One arm on this rank (module docstring): timed steps, then bytes, costs and peak.  Its
    pair's other arm is built and stepped beside it first, torch's before fxpar's whatever is
    timed, so both arms of a pair are timed in processes set up alike."""
    torch.set_num_threads(1)
    other = partner(arm_name)
    built: dict[str, Arm] = {}
    for name in sorted([arm_name] + ([other] if other else []), key=lambda n: not n.startswith("torch")):
        built[name], batches = _build(name, dtype)
    pick = lambda i: batches[i % len(batches)]
    for i in range(WARMUP):
        for a in built.values():
            _step(a, pick(i))
    arm = built[arm_name]
    dist.barrier()
    times = []
    for i in range(steps):
        start = time.perf_counter()
        _step(arm, pick(WARMUP + i))
        dist.barrier()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        _step(arm, pick(0))
    sent = wire_bytes(collective_events(prof), WORLD)
    dist.barrier()
    audit = StepAudit()
    if arm_name.endswith("compiled"):   # dynamo runs no graph under a dispatch mode: not audited
        _step(arm, pick(1))
        cost = None
    else:
        with audit as cost:
            arm.train(pick(1))
        arm.optimizer.step()
        arm.optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    with TensorPeak(arm.resident()) as peak:
        _step(arm, pick(2))
    dist.barrier()
    return {"rank": dist.get_rank(), "times": times, "bytes": sent, "cost": cost.summary() if cost else None,
            "all_reads": None if cost is None else len(cost.host_reads) + len(cost.model_reads),
            "peak_bytes": peak.peak_bytes, "padding_bytes": arm.padding_bytes}


# ---- the run (parent process) --------------------------------------------------------------------------
def run_arm(arm: str, dtype: str, steps: int) -> list[dict[str, Any]]:
    with WorkerPool(WORLD, env={"TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}) as pool:
        return pool.run(arm_worker, arm, dtype, steps, timeout=1800)


def _or(value: Any) -> str:
    return "-" if value is None else str(value)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def summarize(results: dict[tuple[str, str], list[list[dict[str, Any]]]], dtypes: list[str]
              ) -> tuple[list[str], list[list[Any]], list[dict[str, Any]]]:
    """Rows per (dtype, fxpar arm): its figures and its torch counterpart's, and the ratios over
    the rounds.  ``results[(dtype, arm)]``: one list of per-rank dicts per round."""
    head = ["dtype", "arm", "torch arm", "MiB sent/rank/step fxpar", "torch", "bytes ratio", "padding KiB/unit",
            "fxpar host reads", "syncs", "extra ops fxpar", "extra ops torch", "step ratio median [range]",
            "rounds", "peak MiB fxpar", "peak MiB torch", "peak ratio"]
    rows, runs = [], []
    for dtype in dtypes:
        for mine, theirs in PAIRS.items():
            a, b = results.get((dtype, mine)), results.get((dtype, theirs))
            if not a or not b or (mine.endswith("cast all") and dtype == "fp32"):
                continue
            plain = results.get((dtype, "plain compiled" if mine.endswith("compiled") else "plain"))
            plain_ops = statistics.median(r[0]["cost"]["ops"] for r in plain) if plain and plain[0][0]["cost"] else None
            staged = mine == "fxpar PP"   # the plain arm is no baseline for a pipeline's ops (docstring)
            ratios = [statistics.median(x[0]["times"]) / statistics.median(y[0]["times"]) for x, y in zip(a, b)]
            sent_a, sent_b = (max(r["bytes"]["total"] for r in x[-1]) for x in (a, b))
            ops_a, ops_b = (sum(r["cost"]["ops"] for r in x[-1]) if all(r["cost"] for r in x[-1]) else None
                            for x in (a, b))
            if not staged:
                ops_a, ops_b = (a[-1][0]["cost"]["ops"] if a[-1][0]["cost"] else None,
                                b[-1][0]["cost"]["ops"] if b[-1][0]["cost"] else None)
            extra_a = (None if ops_a is None or ops_b is None else int(ops_a - ops_b)) if staged \
                else (None if plain_ops is None or ops_a is None else int(ops_a - plain_ops))
            extra_b = None if staged or plain_ops is None or ops_b is None else int(ops_b - plain_ops)
            peak_a = max(r["peak_bytes"] for r in a[-1])
            peak_b = max(r["peak_bytes"] for r in b[-1])
            audited = all(r["cost"] for r in a[-1])
            reads = max(r["cost"]["host_reads"] for r in a[-1]) if audited else None
            syncs = max(r["cost"]["syncs"] for r in a[-1]) if audited else None
            pad = a[-1][0]["padding_bytes"]
            entry = {"dtype": dtype, "arm": mine, "torch": theirs, "bytes_fxpar": sent_a, "bytes_torch": sent_b,
                     "bytes_ratio": sent_a / sent_b if sent_b else None, "host_reads": reads, "syncs": syncs,
                     "extra_ops_fxpar": extra_a, "extra_ops_torch": extra_b, "ops_fxpar": ops_a, "ops_torch": ops_b,
                     "extra_ops_base": "torch" if staged else "plain",
                     "step_ratios": ratios, "peak_fxpar": peak_a, "peak_torch": peak_b,
                     "by_kind_fxpar": a[-1][0]["bytes"], "by_kind_torch": b[-1][0]["bytes"], "padding_bytes": pad,
                     "vs_plain": None if not plain else [statistics.median(x[0]["times"]) / statistics.median(y[0]["times"])
                                                         for x, y in zip(a, plain)]}
            runs.append(entry)
            rows.append([dtype, mine, theirs, f"{sent_a / MIB:.2f}", f"{sent_b / MIB:.2f}",
                         "-" if not sent_b else f"{sent_a / sent_b:.3f}", "-" if pad is None else f"{pad / 1024:.2f}",
                         _or(reads), _or(syncs), _or(extra_a), "base" if staged else _or(extra_b),
                         _spread(ratios), len(ratios),
                         f"{peak_a / MIB:.1f}", f"{peak_b / MIB:.1f}", f"{peak_a / peak_b:.3f}"])
    return head, rows, runs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every arm, in alternating order")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm and round")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--quick", action="store_true", help="1 round of 2 timed steps, fp32 only")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead of benchmarks/results")
    args = ap.parse_args(argv)
    rounds, steps, dtypes = (1, 2, ["fp32"]) if args.quick else (args.rounds, args.steps, args.dtypes)
    results: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    for k in range(rounds):
        for dtype in dtypes:
            arms = [a for a in args.arms if dtype == "bf16" or not a.endswith("cast all")]
            order = arms if k % 2 == 0 else list(reversed(arms))
            for arm in order:
                t0 = time.perf_counter()
                results.setdefault((dtype, arm), []).append(run_arm(arm, dtype, steps))
                print(f"round {k + 1}/{rounds} {dtype} {arm}: "
                      f"{statistics.median(results[(dtype, arm)][-1][0]['times']):.3f} s/step "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    head, rows, runs = summarize(results, dtypes)
    raw = {f"{d}|{a}": v for (d, a), v in results.items()}
    return finish("torch_parity", title="fxpar's runtime against torch's own (gloo CPU ranks, equal speeds)",
                  caption=f"fxpar vs torch on the same model, batch and split: 2 gloo CPU ranks (1 thread each), "
                          f"{MODEL.name} ({BATCH}x{SEQ} tokens), {rounds} round(s) of {steps} timed steps "
                          f"({time.perf_counter() - started:.0f} s in all). Bytes from torch's profiler; reads, "
                          f"syncs and ops from fxpar.runtime.step_audit; ratios fxpar / torch:",
                  head=head, rows=rows, quick=args.quick, out=args.out, runs=runs, raw=raw,
                  settings={"rounds": rounds, "steps": steps, "dtypes": dtypes, "model": MODEL.hf_config,
                            "batch": BATCH, "seq": SEQ})


if __name__ == "__main__":
    main()
