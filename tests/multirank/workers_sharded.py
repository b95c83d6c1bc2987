"""Functions that run inside spawned gloo ranks for the sharded data-parallel tests (module level,
so they pickle by reference)."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

import fxpar
from fxpar.checkpoint import load_checkpoint, save_checkpoint
from fxpar.codegen.common.module import RankModule
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.forms.sharded.apply_buffers import GatherBuffers, ReduceBuffers
from fxpar.runtime.ragged import PackedLayout, RaggedLayout
from tests.parity import gradient_gaps, snapshot, trajectory_gaps
from tests.workers import global_batch, tiny_model

LR = 1e-3


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class PlainNet(torch.nn.Module):
    """A plain module: an input layer, 3 residual blocks (``blocks.<i>``), a head, a 0-d scale."""

    def __init__(self, width: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, classes)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return torch.nn.functional.cross_entropy(self.head(h) * self.scale, y)


class RoutedBlock(Block):
    """A block with a branch only the rows in ``chosen`` take (as an expert only some tokens
    choose): a rank without such rows gets no gradient for ``rare``."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.rare = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if bool(chosen.any()):
            out = out.index_add(0, chosen.nonzero().flatten(), self.rare(x[chosen]))
        return out


class RoutedNet(PlainNet):
    """:class:`PlainNet` whose 5 blocks route the rows with a positive first input feature (5: a
    rank waiting in its backward for a reduce-scatter the other rank only starts at the round's
    end is further behind than the one block prefetched)."""

    def __init__(self, width: int = 24, classes: int = 5) -> None:
        super().__init__(width, classes)
        self.blocks = torch.nn.ModuleList(RoutedBlock(width) for _ in range(5))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h, chosen = self.inp(x), x[:, 0] > 0
        for b in self.blocks:
            h = b(h, chosen)
        return torch.nn.functional.cross_entropy(self.head(h) * self.scale, y)


def _plain_data(batch: int, steps: int, routed_rows: int | None) -> list:
    gen = torch.Generator().manual_seed(3)
    data = []
    for _ in range(steps):
        x = torch.randn(batch, 7, generator=gen)
        if routed_rows is not None:   # only the first rows (rank 0's share) take the branch
            x[:, 0] = -1.0
            x[:routed_rows, 0] = 1.0
        data.append((x, torch.randint(0, 5, (batch,), generator=gen)))
    return data


def _case(family: str, batch: int, steps: int):
    """Model, its single-process reference, and ``steps`` global batches (``routed``: a plain
    module whose branch only the first row of each batch takes)."""
    if family in ("plain", "routed"):
        torch.manual_seed(0)
        model = RoutedNet() if family == "routed" else PlainNet()
        data = _plain_data(batch, steps, 1 if family == "routed" else None)
    else:
        model = tiny_model(family)
        data = [global_batch(model, batch, 12, seed=1 + s) for s in range(steps)]
    return model, copy.deepcopy(model), data


def _ref_loss(reference: torch.nn.Module, b) -> torch.Tensor:
    return reference(b) if isinstance(b, tuple) else reference(**b, use_cache=False).loss


def _full_grads(pm: RankModule, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient reassembled from the ranks' row shards (all-gather of objects
    over ``group``, None: the job)."""
    mine = {t.names[0]: (pm.form.owned_rows()[t.names[0]], t.shard.grad.detach().clone() if t.shard.grad is not None
                         else None, tuple(t.full.shape)) for t in pm.form.tensors}
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    out = {}
    for name, (_, _, shape) in mine.items():
        full = torch.zeros(shape)
        for table in every:
            (lo, hi), g, _ = table[name]
            if hi > lo and g is not None:
                (full.view(1) if not shape else full[lo:hi]).copy_(g.reshape(-1) if not shape else g)
        out[name] = full
    return out


def sharded_parity(family: str, batch_split: list[int], state_split: list[int], shard_stage: int, *,
                   steps: int = 3, micro_batch_size: int | None = None, checkpointing: list[bool] | None = None,
                   offload: list[bool] | None = None) -> dict:
    """``steps`` AdamW steps of sharded DP vs one process: per step the losses and the reassembled
    gradients' gaps (``steps``: ``loss``, ``ref_loss``, ``grads``), the worst absolute loss and
    gradient differences over the steps (``loss``, ``grad``), and the weights after the steps
    (rank 0: ``weights``, a trajectory gap; ``weight``, the largest element gap)."""
    rank = dist.get_rank()
    model, reference, data = _case(family, sum(batch_split), steps)
    initial = snapshot(reference)
    cluster = fxpar.Cluster.emulated([1.0] * len(batch_split))
    plan = sharded_data_parallel_plan(cluster, batch_split=batch_split, state_split=state_split,
                                      shard_stage=shard_stage, micro_batch_size=micro_batch_size,
                                      activation_checkpointing=checkpointing, offload_optimizer=offload)
    example = data[0] if not isinstance(data[0], tuple) else None
    pm = RankModule(model, plan, rank, example_inputs=example, emulate=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    names = dict(reference.named_parameters())
    out = {"rank": rank, "loss": 0.0, "grad": 0.0, "weight": 0.0, "n_grads": 0, "peak": 0, "steps": [],
           "shard_devices": sorted({str(p.device) for p in pm.parameters()}),
           "shard_numel": sum(p.numel() for p in pm.parameters()),
           "full_numel": sum(p.numel() for p in reference.parameters())}
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = _ref_loss(reference, b)
        ref_loss.backward()
        grads = _full_grads(pm)
        gaps = gradient_gaps(((n, g, names[n].grad) for n, g in grads.items()), reference, steps_before=k)
        out["steps"].append({"loss": float(loss), "ref_loss": float(ref_loss.detach()), "grads": gaps})
        out["loss"] = max(out["loss"], abs(float(loss) - float(ref_loss.detach())))
        out["grad"] = max(out["grad"], gaps.max_abs)
        out["n_grads"] = len(grads)
        out["peak"] = max(out["peak"], pm.form.peak_gathered_bytes)
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    full = pm.gather_state_dict(dst=0)
    if rank == 0:
        out["weights"] = trajectory_gaps((n, full[n], p, initial[n]) for n, p in reference.named_parameters())
        out["weight"], out["worst_weight"] = out["weights"].max_abs, out["weights"].worst
    out["whole_bytes"] = sum(t.full.numel() * t.full.element_size() for t in pm.form.tensors)
    out["block_bytes"] = max(u.full_bytes for u in pm.form._units[1:]) if len(pm.form._units) > 1 else 0
    out["rest_bytes"] = pm.form._units[0].full_bytes
    out["gathered_after_step"] = pm.form.gathered_bytes()
    return out


def sharded_in_a_subgroup(shard_stage: int, steps: int = 2) -> dict:
    """Ranks 1 and 2 of a 3-rank job run a 2-rank sharded plan (batch 3:1, state 1:3) inside
    their own process group (``group=``: plan rank ``r`` is the group's ``r``-th rank) while rank
    0 runs nothing, ranks 1 and 2 naming groups they make alone differently; per step the loss
    and the reassembled gradients' gaps against one process
    (``steps``), as :func:`sharded_parity`."""
    group = dist.new_group([1, 2])   # every rank of the job takes part in making this one
    # rank 1 alone makes one more, which advances the salt torch names groups by on rank 1 and
    # not on rank 2 (fxpar.compat.group_name_salt): a group ranks 1 and 2 make alone would be
    # named differently on each (fxpar.runtime.distributed.members_group)
    if dist.get_rank() == 1:
        dist.new_group([1], use_local_synchronization=True)
    rank = dist.get_rank()
    out: dict = {"rank": rank, "steps": []}
    if rank == 0:
        return out
    model, reference, data = _case("llama", 4, steps)
    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0, 1.0]), batch_split=[3, 1], state_split=[1, 3],
                                      shard_stage=shard_stage)
    pm = RankModule(model, plan, dist.get_rank(group), group=group, example_inputs=data[0],
                                   emulate=False)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=LR), torch.optim.AdamW(reference.parameters(), lr=LR)
    names = dict(reference.named_parameters())
    for k, b in enumerate(data):
        loss = pm.step(b)
        ref_loss = _ref_loss(reference, b)
        ref_loss.backward()
        grads = _full_grads(pm, group)
        gaps = gradient_gaps(((n, g, names[n].grad) for n, g in grads.items()), reference, steps_before=k)
        out["steps"].append({"loss": float(loss), "ref_loss": float(ref_loss.detach()), "grads": gaps})
        opt.step(); opt.zero_grad(set_to_none=True)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    return out


def _sharded(model, batch_split, state_split, shard_stage, **kw) -> RankModule:
    cluster = fxpar.Cluster.emulated([1.0] * len(batch_split))
    plan = sharded_data_parallel_plan(cluster, batch_split=batch_split, state_split=state_split,
                                      shard_stage=shard_stage, **kw)
    return RankModule(model, plan, dist.get_rank(), emulate=False)


def _data_parallel(model, batch_split) -> RankModule:
    cluster = fxpar.Cluster.emulated([1.0] * len(batch_split))
    sharded = sharded_data_parallel_plan(cluster, batch_split=batch_split, state_split=[1] * len(batch_split))
    stage = dataclasses.replace(sharded.stages[0], sharded=None)
    plan = dataclasses.replace(sharded, form="data_parallel", stages=(stage,))
    return RankModule(model, plan, dist.get_rank(), emulate=False)


def _full_state(pm) -> dict[str, torch.Tensor]:
    """The full parameters on every rank (rank 0's gather, broadcast as objects)."""
    full = pm.gather_state_dict(dst=0)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_round_trip(first: str, second: str, root: str) -> dict:
    """Train 2 steps under ``first`` ("dp", "zero3-1:3", "zero2-2:1"), save with its AdamW state,
    load under ``second``, train 1 more step on both: the loaded weights equal the saved ones and
    the next step (which reads the moved AdamW state) agrees: the two losses (``loss_a``,
    ``loss_b``) and the two runs' weights after it (``next_step``: the trajectory gap of the
    second against the first, from the saved weights)."""
    model = tiny_model("llama")
    data = [global_batch(model, 4, 12, seed=7 + s) for s in range(3)]

    def build(kind: str):
        copy_ = copy.deepcopy(model)
        if kind == "dp":
            return _data_parallel(copy_, [3, 1])
        stage, split = kind.split("-")
        return _sharded(copy_, [3, 1], [int(w) for w in split.split(":")], int(stage[-1]))

    a = build(first)
    opt_a = torch.optim.AdamW(a.parameters(), lr=LR)
    for b in data[:2]:
        a.step(b); opt_a.step(); opt_a.zero_grad()
    saved = _full_state(a)
    path = root + "/ckpt"
    save_checkpoint(a, opt_a, path, step=2)
    b_ = build(second)
    opt_b = torch.optim.AdamW(b_.parameters(), lr=LR)
    meta = load_checkpoint(b_, opt_b, path)
    loaded = _full_state(b_)
    out = {"saved_by": meta.saved_by, "load_diff": max((saved[n] - loaded[n]).abs().max().item() for n in saved)}
    la, lb = a.step(data[2]), b_.step(data[2])
    opt_a.step(); opt_b.step()
    after_a, after_b = _full_state(a), _full_state(b_)
    out["loss_a"], out["loss_b"] = float(la), float(lb)
    out["loss_diff"] = abs(float(la) - float(lb))
    out["next_step"] = trajectory_gaps((n, after_b[n], after_a[n], saved[n]) for n in after_a)
    out["next_step_diff"] = out["next_step"].max_abs
    return out


def save_gather_clip(root: str) -> dict:
    """``save_pretrained`` writes the full model (HF loads it), ``gather_state_dict`` names every
    FQN, ``clip_grad_norm_`` clips by the whole model's norm, on ZeRO-3 1:3 with rank 1 offloading."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    data = global_batch(model, 4, 12, seed=5)
    pm = _sharded(model, [3, 1], [1, 3], 3, offload_optimizer=[False, True])
    pm.step(data)
    reference(**data, use_cache=False).loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = pm.clip_grad_norm_(0.05)
    grads = _full_grads(pm)
    clipped = gradient_gaps(((n, grads[n], p.grad) for n, p in reference.named_parameters()), reference)
    out = {"norm_diff": abs(float(norm) - float(ref_norm)), "norm": float(norm), "ref_norm": float(ref_norm),
           "clipped": clipped, "clipped_diff": clipped.max_abs}
    pm.save_pretrained(root + "/hf")
    full = pm.gather_state_dict(dst=0)
    if dist.get_rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(root + "/hf")
        out["hf_diff"] = max((p.detach() - full[n]).abs().max().item() for n, p in loaded.named_parameters())
        out["names_equal"] = set(full) == {n for n, _ in reference.named_parameters(remove_duplicate=False)}
    return out


def structure(shard_stage: int, checkpointing: list[bool], offload: list[bool]) -> dict:
    """What each rank holds and does, on a 3-block plain model: live full-parameter bytes at each
    block's forward (hooks inside the blocks), inner forwards per step (recomputation), where the
    shards and the AdamW state live (offload)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = PlainNet()
    pm = _sharded(model, [3, 1], [1, 3], shard_stage, activation_checkpointing=checkpointing,
                  offload_optimizer=offload)
    live, calls = [], [0]
    for i, block in enumerate(model.blocks):
        def probe(module, args, i=i):
            calls[0] += 1
            if torch.is_grad_enabled():
                live.append((i, pm.form.gathered_bytes(), pm.form.inflight_bytes(),
                             sorted(u.name for u in pm.form._units if u.gathered)))
        block.up.register_forward_pre_hook(probe)
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(4, 7, generator=gen), torch.randint(0, 5, (4,), generator=gen))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    pm.step(batch)
    opt.step()
    state_devices = sorted({str(v.device) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)})
    shared = [t.shard.untyped_storage().data_ptr() == t.local.untyped_storage().data_ptr()
              for t in pm.form.tensors if t.local.numel()]
    return {"rank": rank, "live": live, "inner_calls": calls[0], "units": [u.name for u in pm.form._units],
            "block_bytes": [u.full_bytes for u in pm.form._units[1:]], "rest_bytes": pm.form._units[0].full_bytes,
            "buffer_bytes": [u.buffer_bytes for u in pm.form._units[1:]],
            "whole_bytes": sum(u.full_bytes for u in pm.form._units), "peak": pm.form.peak_gathered_bytes,
            "after": pm.form.gathered_bytes(), "state_devices": state_devices,
            "shards_are_device_copies": all(shared), "shards_separate": not any(shared),
            "param_devices": sorted({str(p.device) for p in pm.parameters()})}


def through_auto(shard_stage: int) -> dict:
    """``fxpar.auto(..., plan=<sharded plan>)`` builds the sharded module; ``make_optimizer`` and
    ``step`` train it like the other kinds."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    data = global_batch(model, 4, 12, seed=11)
    cluster = fxpar.Cluster.emulated([1.0, 0.5])
    plan = sharded_data_parallel_plan(cluster, batch_split=[3, 1], state_split=[1, 3], shard_stage=shard_stage)
    pm = fxpar.auto(model, cluster, data, plan=plan)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR)
    loss = pm.step(data)
    ref = reference(**data, use_cache=False).loss
    opt.step()
    return {"kind": type(pm.form).__name__, "loss_diff": abs(float(loss) - float(ref.detach())),
            "loss": float(loss), "ref_loss": float(ref.detach()),
            "opt_numel": sum(p.numel() for g in opt.param_groups for p in g["params"]),
            "full_numel": sum(p.numel() for p in reference.parameters())}


def ragged_collectives(weights: list[int]) -> dict:
    """A unit's all-gather and reduce-scatter buffers on their own: parameters of 2-d, 1-d (fewer
    rows than ranks) and 0-d shapes, two wire dtypes (fp32 and bf16 regions), weights with a zero;
    the gather rebuilds each tensor in its wire dtype, the reduce-scatter (fp32) gives each rank
    the sum over ranks of its rows of the gradients, whatever their dtype."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = [(5, 3), (1,), (), (4,), (3, 2)]
    f32, b16 = torch.float32, torch.bfloat16
    wire = [f32, b16, f32, b16, b16]
    rows = RaggedLayout.of(shapes, weights)
    layout = PackedLayout.of(rows, [d.itemsize for d in wire])
    gen = torch.Generator().manual_seed(0)
    truth = [torch.randn(s, generator=gen) for s in shapes]
    shards = []
    for i, t in enumerate(truth):
        lo, hi = rows.rows[i][rank]
        shards.append(t.reshape(-1)[lo:hi].clone() if not t.dim() else t[lo:hi].clone())
    cpu = torch.device("cpu")
    gather = GatherBuffers(layout, [f32, b16], rank, cpu, [True] * len(shapes))
    sources = [[shards[i].reshape(-1) for i in region] for region in layout.regions]
    gather.finish(gather.launch(sources, None, True))
    exact = all(torch.equal(gather.fulls[i].detach(), truth[i].to(wire[i])) for i in range(len(shapes)))
    order = sorted(range(len(shapes)), key=lambda i: (wire[i] == f32, str(wire[i]), i))
    grad_rows = RaggedLayout.of([shapes[i] for i in order], weights)
    reduce = ReduceBuffers(PackedLayout.of(grad_rows, [4] * len(order)), f32, [wire[i] for i in order],
                           rank, cpu, cpu)
    fulls = [gather.fulls[i] for i in order]
    reduce.adopt(fulls, None)
    contributions = [(truth[i] * (rank + 1)).to(wire[i]) for i in order]  # rank r adds (r+1)·t
    with torch.no_grad():
        for f, g in zip(fulls, contributions):
            f.grad.add_(g)
    masters = [torch.nn.Parameter(torch.zeros(grad_rows.local_shape(k, rank))) for k in range(len(order))]
    reduce.prepare_shard_grads(masters)
    reduce.finish(reduce.launch(fulls, None, True))
    expect = []
    for k, i in enumerate(order):
        total = sum((truth[i] * (r + 1)).to(wire[i]).float() for r in range(world))
        lo, hi = grad_rows.rows[k][rank]
        expect.append(total.reshape(-1)[lo:hi] if not total.dim() else total[lo:hi])
    return {"gather_exact": exact,
            "reduce_diff": max(((m.grad.reshape(-1) - e.reshape(-1)).abs().max().item() if e.numel() else 0.0)
                               for m, e in zip(masters, expect)),
            "grads_dropped": all(f.grad is None for f in fulls),
            "part_bytes": layout.part_bytes, "padding_bytes": layout.padding_bytes,
            "region_bytes": [layout.region_offset(len(layout.regions), r) for r in range(world)],
            "sizes": [rows.sizes(r) for r in range(world)]}


def collective_sequence(shard_stage: int) -> dict:
    """Every collective a rank issues in one step, recorded by wrapping ``torch.distributed``'s
    functions (the ragged module looks them up at each call): op, group, sizes, devices.  Rank 0
    trains 3 micro-batches and recomputes, rank 1 trains 1 and offloads: the per-group sequences
    must still be identical, with NCCL's size rule (output = world x input) and device tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("llama")
    data = global_batch(model, 4, 12, seed=3)
    pm = _sharded(model, [3, 1], [1, 3], shard_stage, micro_batch_size=1,
                  activation_checkpointing=[True, False], offload_optimizer=[False, True])
    calls: list = []
    originals = {}
    # the names the runtime calls (fxpar.runtime.ragged): torch 2.13's, or the older ones before
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    for name in (gather, scatter, "all_reduce"):
        original = getattr(dist, name)
        originals[name] = original

        def recorded(out, *args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            tensors = [out] + [a for a in args if torch.is_tensor(a)]
            calls.append((_name, tuple(dist.get_process_group_ranks(group)) if group is not None else "world",
                          id(group) if group is not None else 0, [t.numel() for t in tensors],
                          sorted({str(t.device) for t in tensors})))
            return _original(out, *args, **kwargs)
        setattr(dist, name, recorded)
    try:
        pm.step(data)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    sizes_ok = all(sizes[0] == world * sizes[1] if op == gather else
                   sizes[1] == world * sizes[0] if op == scatter else True
                   for op, _, _, sizes, _ in calls)
    by_group: dict = {}
    for op, ranks, gid, sizes, _ in calls:
        by_group.setdefault(f"{op.split('_')[0]}:{ranks}", []).append((op, sizes[0]))
    return {"rank": rank, "sizes_ok": sizes_ok, "devices": sorted({d for c in calls for d in c[4]}),
            "groups": {k: v for k, v in by_group.items()}, "n_calls": len(calls),
            "distinct_groups": len({c[2] for c in calls})}


def bf16_parity(family: str, shard_stage: int, cast: str, reduce_dtype: str = "fp32", steps: int = 2) -> dict:
    """A bf16 sharded plan (batch 3:1, state 1:3) under its dtype policy against one process under
    bf16 autocast: ``cast="autocast"`` against the fp32 model, ``"all"`` against the model whose
    parameters are cast to bf16 (its buffers not: only parameters are gathered).  Per step: the
    loss, every whole gradient (``gradient_gaps``), and the wire dtypes of the all-gathers (the
    collective audit's record of this rank's calls)."""
    from fxpar.dtype_policy import DtypePolicy
    from fxpar.runtime.audit import CollectiveAudit

    rank = dist.get_rank()
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    if cast == "all":
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
    data = [global_batch(model, 4, 12, seed=20 + s) for s in range(steps)]
    cluster = fxpar.Cluster.emulated([1.0, 1.0])
    plan = sharded_data_parallel_plan(cluster, batch_split=[3, 1], state_split=[1, 3], shard_stage=shard_stage,
                                      dtype="bf16")
    plan = dataclasses.replace(plan, dtype_policy=DtypePolicy(param_dtype="bf16", reduce_dtype=reduce_dtype,
                                                              cast=cast))
    pm = RankModule(model, plan, rank, emulate=False)
    names = dict(reference.named_parameters())
    out = {"rank": rank, "steps": []}
    for k, b in enumerate(data):
        audit = CollectiveAudit(torch.device("cpu"), phase="step")
        with audit:
            loss = pm.step(b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = reference(**b, use_cache=False).loss
        ref_loss.float().backward()
        grads = _full_grads(pm)
        gaps = gradient_gaps(((n, g, names[n].grad.float()) for n, g in grads.items()), reference)
        sends = [c for c in audit.calls if c.op in ("all_gather_single", "all_gather_into_tensor")]
        reduces = [c for c in audit.calls if c.op in ("reduce_scatter_single", "reduce_scatter_tensor")]
        out["steps"].append({"loss": float(loss), "ref_loss": float(ref_loss.detach()), "grads": gaps,
                             "gather_bytes": sum(int(torch.Size(c.shapes[1]).numel()) for c in sends),
                             "reduce_dtypes": sorted({c.dtypes[0] for c in reduces}),
                             "wire": sorted({str(d).removeprefix("torch.") for u in pm.form._units for d in u.train.wire})})
        for p in reference.parameters():
            p.grad = None
        for p in pm.parameters():
            p.grad = None
    # bytes a rank sends per all-gather, in the training mode against fp32 (the exact mode)
    out["part_ratio"] = (sum(u.train.gather.layout.part_bytes for u in pm.form._units)
                         / sum(u.exact.gather.layout.part_bytes for u in pm.form._units))
    return out
