"""The comparison rules of the parity tests: a parallel run against one process on the same
global batch, in fp32.  Every bound is a multiple of fp32's unit roundoff

    eps = torch.finfo(torch.float32).eps = 2**-23 ≈ 1.19e-7

chosen from the size of the sums a parallel plan reorders, never from one machine's run, and
held at least 10x below the gap of a real bug (``tests/graph/test_parity_rules.py`` plants such bugs
and checks each rule fails them; every run's own gaps sit far below the bounds).

What a parallel plan changes is the *order* of floating-point sums: data parallelism and
pipeline micro-batches cut the sum over the batch's tokens into per-rank or per-micro-batch
partial sums, tensor parallelism cuts the sums over hidden features, expert parallelism moves
tokens between ranks.  A sum of K terms computed in two orders differs by at most
2(K − 1)·eps·Σ|t| (the worst case, O(K·eps): every rounding error aligned) and typically by
O(√K·eps) of the terms' magnitude (the rounding errors are a random walk of K steps).  The
largest such sums in these tests are the ones over the batch's tokens, K = batch × sequence
≤ 512 (1024 in one test).

The three rules:

- :func:`check_loss` — the relative gap ``|l − l_ref| / |l_ref| ≤ LOSS_RTOL``.
- :func:`check_gradients` — per parameter ``‖g − g_ref‖₂ ≤ rtol · (‖g_ref‖₂ + δ·F)``,
  with ``F = ‖G_ref‖₂ · √(m / M)`` the parameter's floor (see :data:`GRAD_FLOOR`); rtol is
  :data:`GRAD_RTOL` while both runs hold the same weights, and :func:`grad_rtol` once they
  have taken optimizer steps.
- :func:`check_trajectory` — after optimizer steps, ``‖w − w_ref‖₂ / ‖w_ref − w₀‖₂`` over the
  compared parameters, ≤ :data:`TRAJECTORY_RTOL` of the optimizer.

Each returns a :class:`Report` (the worst parameter, its gap and its bound), so a failed
assertion says what failed: ``expect(check_loss(...), check_gradients(...))``.  The workers
that run inside gloo ranks measure with :func:`gradient_gaps` and :func:`trajectory_gaps` (small
picklable records) and the tests judge them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

#: fp32's unit roundoff (2**-23): every bound below is a multiple of it.
EPS = float(torch.finfo(torch.float32).eps)

#: Loss: ``|l − l_ref| ≤ LOSS_RTOL · |l_ref|``, 64·eps ≈ 7.6e-6.
#:
#: The loss is a token-weighted mean of N per-token cross entropies (each a log-sum-exp over the
#: vocabulary): positive terms, so the sum is perfectly conditioned and reordering it changes it
#: by a random walk of N roundings, about √N·eps relative (≤ 32·eps for N ≤ 1024); the ranks'
#: weights n_r / N and the products add a few eps.  64·eps is 2–3x that typical gap (a few
#: standard deviations of the walk).  After AdamW steps the two runs' weights differ (see
#: :data:`TRAJECTORY_RTOL`), but mostly where the gradient is near zero — that is where last-bit
#: noise changes Adam's update — and there the loss is flat to first order, so the same bound
#: holds at every step.  A real bug moves the loss by a sample's share of it: a sample dropped or
#: counted twice, or two ranks' token weights swapped, changes it by ~1e-3 relative — 120–160x the
#: bound in ``tests/graph/test_parity_rules.py`` (a tiny Mixtral's smallest such gap, 3e-4, is 40x).
LOSS_RTOL = 64 * EPS

#: Gradients: per parameter ``‖g − g_ref‖₂ ≤ GRAD_RTOL · (‖g_ref‖₂ + GRAD_FLOOR·‖G_ref‖₂·√(m/M))``,
#: 1024·eps ≈ 1.2e-4.
#:
#: A weight's gradient is a sum over the batch's K ≤ 512 tokens (reordered by data parallelism,
#: micro-batches and expert dispatch) of products of activations and back-propagated errors,
#: themselves sums over d ≤ 512 features (reordered by tensor parallelism).  The worst case of a
#: reordered sum of K = 512 terms is 2(K − 1)·eps ≈ 1022·eps of its terms' magnitude: the bound
#: is that worst case; the typical gap of the longest reductions here (K ≤ 1024), a few
#: √K·eps ≈ 20–60·eps, sits 20–50x below it.  This holds while both runs hold the same weights
#: (the first step, or no optimizer step in between); after optimizer steps see
#: :func:`grad_rtol`.  A real bug is at least a 1% gradient error (a loss scaled by 1.01:
#: 1e-2 ≈ 84000·eps, ≥ 0.7e-2 with the floor), 55x the bound; a dropped or doubled sample or
#: swapped token weights are 30% and more.
GRAD_RTOL = 1024 * EPS

#: δ of the gradient floor.  A parameter's rounding noise is set by the magnitude of the terms
#: summed into it, not by its own (possibly cancelled, near-zero) gradient: a bias whose
#: contributions cancel, or an embedding row few tokens touch, carries the noise of terms as
#: large as the rest of the model's.  Its floor is ``‖G_ref‖₂ · √(m / M)`` — the norm its m
#: elements would have if the whole model's gradient ``G_ref`` (M elements) were spread evenly
#: over them — so for equal-size tensors ``‖G_ref‖₂ / √n_params``; δ = 1 takes that share as is.
GRAD_FLOOR = 1.0

#: The whole model's gradient norm (``clip_grad_norm_``): by the triangle inequality,
#: ``|‖G‖ − ‖G_ref‖| ≤ ‖G − G_ref‖``, and the per-parameter rule summed in quadrature gives
#: ``‖G − G_ref‖ ≤ GRAD_RTOL·(‖G_ref‖ + δ·‖G_ref‖)`` (the floors' squares add up to ‖G_ref‖²):
#: 2·GRAD_RTOL relative for δ = 1.
NORM_RTOL = (1 + GRAD_FLOOR) * GRAD_RTOL

#: Weights after optimizer steps: ``‖w − w_ref‖₂ / ‖w_ref − w₀‖₂`` (the gap as a fraction of the
#: distance the reference moved), per optimizer.
#:
#: ``"adamw"``: 2·√GRAD_RTOL = 64·√eps ≈ 2.2e-2.  Adam's update ``lr·m̂/(√v̂ + ε)`` is about
#: ``lr·sign(g)`` whatever |g|, so an element-wise weight gap is no fair measure: a last-bit
#: difference of a gradient near zero can flip its update, a gap of 2·lr per step on that element.
#: Gradients that agree to a relative ρ flip the update only where |g| ≲ ρ·s (s the magnitude of
#: the terms summed into it): a fraction φ ≈ ρ of the elements for a distribution of gradient
#: values flat near zero.  Each moves by at most 2·lr per step off the reference, which moves
#: every element by about lr per step, so the gap is ≲ √(φ·(2·lr)²) / lr = 2√φ of the distance
#: moved; with ρ = :data:`GRAD_RTOL`, 2√GRAD_RTOL.  A real bug is far above: two ranks' token
#: weights swapped, or one sample counted twice and one dropped, make gaps of 0.6–0.7 after 3
#: steps (25–30x).  Adam is blind to a gradient scaled uniformly (m̂/√v̂ is scale-free): the gradient rule
#: catches that one.
#:
#: ``"sgd"``: GRAD_RTOL.  SGD's update is linear in the gradient, so ``w − w_ref = −lr·Σ(g − g_ref)``
#: and the trajectory gap is the gradients' relative gap.
TRAJECTORY_RTOL = {"adamw": 2 * math.sqrt(GRAD_RTOL), "sgd": GRAD_RTOL}


def cpu_within_wall(cpu_s: float, wall_s: float) -> bool:
    """A thread's CPU time in a segment is no more than the segment's wall time.  The emulation
    reads the CPU clock inside the wall clock's reads (``fxpar.runtime.emulation``), so only the
    two clocks' rates differ: ``time.perf_counter`` (CLOCK_MONOTONIC) is slewed by NTP by at most
    500 ppm, the thread CPU clock (the scheduler's clock) is not, and each reads to about 1 µs."""
    return cpu_s <= wall_s * (1 + 5e-4) + 1e-6


def grad_rtol(steps_before: int = 0, optimizer: str = "adamw") -> float:
    """The gradient rule's rtol for gradients taken after ``steps_before`` optimizer steps of
    both runs: :data:`GRAD_RTOL` when none (the same weights: only the arithmetic differs), else
    ``GRAD_RTOL + TRAJECTORY_RTOL[optimizer]`` — 2.2e-2 after AdamW steps, 2·GRAD_RTOL after SGD
    steps.

    After optimizer steps the two runs evaluate their gradients at weights that differ by up to
    the trajectory gap τ = ‖w − w_ref‖ / ‖w_ref − w₀‖ (≤ TRAJECTORY_RTOL), and a gradient moves
    with the weights: to first order by H·(w − w_ref).  Over those steps the reference's own
    gradient moved by about H·(w_ref − w₀) — O(1) of its size at these learning rates — so the
    weight gap adds about τ of the gradient's size; the bound adds the largest τ the trajectory
    rule allows.  Under AdamW this is what a last-bit difference becomes once a near-zero
    gradient's update flips sign (a 2·lr change of an element whose weight is itself O(lr)):
    gradients that agreed to 1e-7 on the first step can differ by ~1e-4 on the next (a 4-layer
    Llama in a 2-stage pipeline, lr 1e-2), 1000x what the arithmetic makes.  The loss does not feel it
    (:data:`LOSS_RTOL`); the first step's gradients still hold every run to GRAD_RTOL.  A bug
    present at every step (a wrong shard, a wrong weight: ≥ 30% gaps) is still ≥ 10x past the
    AdamW bound; a 1% error (a scaled loss) is left to the first step's bound."""
    return GRAD_RTOL if steps_before == 0 else GRAD_RTOL + TRAJECTORY_RTOL[optimizer]


#: Mixed precision (bf16 / fp16 autocast on both sides, fp32 master weights): the forward's
#: matmuls round to the autocast dtype, and how the batch is cut into matmuls changes which
#: values round where, so the unit is the low-precision type's eps, not fp32's.  bf16's eps is
#: 2**-7 ≈ 7.8e-3 (fp16's 2**-10 is finer): the loss, a mean over hundreds of tokens whose
#: rounding errors average out, within 1e-2 relative (≈ 1.3 bf16 eps); each gradient, which
#: accumulates the rounded activations of every layer, within 5e-2 in norm relative to
#: ``‖g_ref‖ + floor`` (≈ 6.4 bf16 eps).  A planted 1.01 scale or a dropped sample is not what
#: these catch; they check that the plan runs the autocast forward at all (a wrong dtype or a
#: missing cast is an O(1) gap).
AUTOCAST_LOSS_RTOL, AUTOCAST_GRAD_RTOL = 1e-2, 5e-2


@dataclass(frozen=True)
class Report:
    """One comparison's verdict: ``worst`` (a parameter name, or what was compared) has the
    largest ``gap / bound``; ``ok`` when every compared item is within its bound."""

    kind: str
    ok: bool
    gap: float
    bound: float
    worst: str = ""
    n: int = 1

    @property
    def ratio(self) -> float:
        """gap / bound (0 when both are 0)."""
        if self.bound > 0:
            return self.gap / self.bound
        return 0.0 if self.gap == 0 else math.inf

    def __str__(self) -> str:
        where = f" at {self.worst}" if self.worst else ""
        return (f"{self.kind} {'ok' if self.ok else 'FAILED'}{where}: gap {self.gap:.3e} vs bound "
                f"{self.bound:.3e} ({self.ratio:.3g} of it, {self.n} compared)")


def expect(*reports: Report, context: object = None) -> None:
    """Assert every report is ok; the message lists the failed ones (and ``context``).  With
    ``FXPAR_PARITY_LOG`` set, each report is appended there as a JSON line (the observed gaps
    against their bounds, for a summary across test files)."""
    log = os.environ.get("FXPAR_PARITY_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            for r in reports:
                f.write(json.dumps({"test": test, "context": repr(context), **asdict(r), "ratio": r.ratio}) + "\n")
    failed = [str(r) for r in reports if not r.ok]
    assert not failed, "; ".join(failed) + (f" [{context}]" if context is not None else "")


def check_scalar(kind: str, value: float, ref: float, rtol: float) -> Report:
    """``|value − ref| ≤ rtol·|ref|`` (floats, or 0-d tensors)."""
    value, ref = (float(x.detach()) if torch.is_tensor(x) else float(x) for x in (value, ref))
    gap, bound = abs(value - ref), rtol * abs(ref)
    return Report(kind, gap <= bound, gap, bound, f"{value:.8g} vs {ref:.8g}")


def check_loss(loss: float, ref_loss: float, rtol: float = LOSS_RTOL) -> Report:
    """The loss rule, :data:`LOSS_RTOL`."""
    return check_scalar("loss", loss, ref_loss, rtol)


def norm_rtol(steps_before: int = 0, optimizer: str = "adamw") -> float:
    """The gradient-norm bound ``(1 + δ)·grad_rtol(...)`` (:data:`NORM_RTOL`'s argument, with the
    gradient rule's rtol for the optimizer steps taken before the gradients)."""
    return (1 + GRAD_FLOOR) * grad_rtol(steps_before, optimizer)


def check_norm(norm: float, ref_norm: float, rtol: float = NORM_RTOL) -> Report:
    """The whole model's gradient norm, :data:`NORM_RTOL` (:func:`norm_rtol` after optimizer steps)."""
    return check_scalar("gradient norm", norm, ref_norm, rtol)


# ---- gradients --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GradientGaps:
    """What the gradient rule needs, measured where the gradients live (inside a rank): per
    compared tensor its name, ``‖g − g_ref‖₂``, ``‖g_ref‖₂`` and element count; the whole
    reference model's gradient norm ``‖G_ref‖₂`` and element count M; the largest element-wise
    ``|g − g_ref|`` (for messages); and how many optimizer steps (which optimizer) both runs
    took before these gradients (:func:`grad_rtol`)."""

    names: tuple[str, ...]
    gaps: tuple[float, ...]
    norms: tuple[float, ...]
    sizes: tuple[int, ...]
    total_norm: float
    total_size: int
    max_abs: float
    steps_before: int = 0
    optimizer: str = "adamw"

    def __len__(self) -> int:
        return len(self.names)


def model_totals(tensors: Iterable[torch.Tensor | None], like: Iterable[torch.Tensor] | None = None) -> tuple[float, int]:
    """``(‖G‖₂, M)`` over distinct tensors (a tied weight counted once); a missing gradient
    (``None``) counts as zeros of its parameter's size (``like``, aligned)."""
    seen: set[int] = set()
    square, size = 0.0, 0
    likes = list(like) if like is not None else None
    for i, t in enumerate(tensors):
        ref = t if t is not None else (likes[i] if likes is not None else None)
        if ref is None or id(ref) in seen:
            continue
        seen.add(id(ref))
        size += ref.numel()
        if t is not None:
            square += float(t.detach().double().pow(2).sum())
    return math.sqrt(square), size


def reference_totals(reference: torch.nn.Module) -> tuple[float, int]:
    """``(‖G_ref‖₂, M)``: the gradient norm and element count of the whole single-process model."""
    params = list(reference.parameters())
    return model_totals([p.grad for p in params], params)


def gradient_gaps(pairs: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]],
                  totals: tuple[float, int] | torch.nn.Module, *, steps_before: int = 0,
                  optimizer: str = "adamw") -> GradientGaps:
    """Measure ``(name, g, g_ref)`` pairs (a shard against its slice of the reference; a missing
    gradient is zeros) against ``totals`` — ``(‖G_ref‖₂, M)`` or the reference model itself —
    taken after ``steps_before`` steps of ``optimizer`` on both sides."""
    if isinstance(totals, torch.nn.Module):
        totals = reference_totals(totals)
    names, gaps, norms, sizes, worst = [], [], [], [], 0.0
    for name, g, ref in pairs:
        if g is None and ref is None:
            continue
        g = torch.zeros_like(ref) if g is None else g
        ref = torch.zeros_like(g) if ref is None else ref
        g, ref = g.detach().reshape(-1).double(), ref.detach().reshape(-1).double()
        assert g.shape == ref.shape, (name, tuple(g.shape), tuple(ref.shape))
        diff = g - ref
        names.append(name)
        gaps.append(float(diff.norm()))
        norms.append(float(ref.norm()))
        sizes.append(g.numel())
        if diff.numel():
            worst = max(worst, float(diff.abs().max()))
    return GradientGaps(tuple(names), tuple(gaps), tuple(norms), tuple(sizes), float(totals[0]), int(totals[1]), worst,
                        steps_before, optimizer)


def gradient_bounds(gaps: GradientGaps, rtol: float | None = None, floor: float = GRAD_FLOOR) -> list[float]:
    """Each compared tensor's bound ``rtol·(‖g_ref‖ + floor·‖G_ref‖·√(m/M))`` (rtol by default
    :func:`grad_rtol` of the steps taken before the gradients)."""
    rtol = grad_rtol(gaps.steps_before, gaps.optimizer) if rtol is None else rtol
    total, size = gaps.total_norm, max(gaps.total_size, 1)
    return [rtol * (norm + floor * total * math.sqrt(m / size)) for norm, m in zip(gaps.norms, gaps.sizes)]


def check_gradients(gaps: GradientGaps, rtol: float | None = None, floor: float = GRAD_FLOOR,
                    kind: str | None = None) -> Report:
    """The gradient rule (:func:`grad_rtol` of the steps taken before the gradients, unless
    ``rtol``; :data:`GRAD_FLOOR`) on every measured tensor; the report names the tensor closest
    to (or furthest past) its bound."""
    if kind is None:
        kind = "gradients" + (f" after {gaps.steps_before} {gaps.optimizer} step(s)" if gaps.steps_before else "")
    if not len(gaps):
        return Report(kind, True, 0.0, 0.0, "nothing compared", 0)
    bounds = gradient_bounds(gaps, rtol, floor)
    ratios = [g / b if b > 0 else (0.0 if g == 0 else math.inf) for g, b in zip(gaps.gaps, bounds)]
    i = max(range(len(ratios)), key=ratios.__getitem__)
    return Report(kind, all(r <= 1.0 for r in ratios), gaps.gaps[i], bounds[i], gaps.names[i], len(gaps))


# ---- trajectories -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TrajectoryGaps:
    """Weights after optimizer steps against the reference's: ``‖w − w_ref‖₂`` and the distance
    the reference moved ``‖w_ref − w₀‖₂`` over the compared tensors, the tensor with the largest
    gap, the largest element-wise gap (for messages), the optimizer (its bound) and the count."""

    gap: float
    moved: float
    worst: str
    max_abs: float
    optimizer: str
    n: int


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters by name (every name of a tied one): the w₀ of a trajectory."""
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def trajectory_gaps(triples: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
                    optimizer: str = "adamw") -> TrajectoryGaps:
    """Measure ``(name, w, w_ref, w₀)`` triples (a shard with the slices of the reference and of
    the initial weights)."""
    if optimizer not in TRAJECTORY_RTOL:
        raise ValueError(f"optimizer {optimizer!r}: rules for {sorted(TRAJECTORY_RTOL)}")
    gap2 = moved2 = worst_gap = max_abs = 0.0
    worst, n = "", 0
    for name, w, ref, w0 in triples:
        w, ref, w0 = (t.detach().reshape(-1).double() for t in (w, ref, w0))
        assert w.shape == ref.shape == w0.shape, (name, tuple(w.shape), tuple(ref.shape), tuple(w0.shape))
        d = float((w - ref).pow(2).sum())
        gap2 += d
        moved2 += float((ref - w0).pow(2).sum())
        if w.numel():
            max_abs = max(max_abs, float((w - ref).abs().max()))
        if d > worst_gap:
            worst_gap, worst = d, name
        n += 1
    return TrajectoryGaps(math.sqrt(gap2), math.sqrt(moved2), worst, max_abs, optimizer, n)


def check_trajectory(t: TrajectoryGaps, rtol: float | None = None) -> Report:
    """The trajectory rule (:data:`TRAJECTORY_RTOL` of ``t.optimizer`` unless ``rtol``): the
    gap is ``‖w − w_ref‖``, the bound ``rtol·‖w_ref − w₀‖``; the report names the tensor with the
    largest gap."""
    rtol = TRAJECTORY_RTOL[t.optimizer] if rtol is None else rtol
    bound = rtol * t.moved
    return Report(f"{t.optimizer} trajectory", t.gap <= bound, t.gap, bound, t.worst, t.n)


# ---- what the workers record per step, and the rules applied to it ----------------------------
def step_record(loss, ref_loss, pairs: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]],
                totals: tuple[float, int] | torch.nn.Module, *, steps_before: int = 0,
                optimizer: str = "adamw") -> dict:
    """One training step's measurements inside a rank: the losses (``loss``, ``ref_loss``, and
    ``loss_diff`` = their absolute gap), the gradient gaps of ``pairs`` (``grads``, a
    :class:`GradientGaps`, taken after ``steps_before`` steps of ``optimizer``),
    ``max_grad_abs_diff`` and ``n_grads``."""
    loss, ref_loss = float(loss.detach() if torch.is_tensor(loss) else loss), \
        float(ref_loss.detach() if torch.is_tensor(ref_loss) else ref_loss)
    grads = gradient_gaps(pairs, totals, steps_before=steps_before, optimizer=optimizer)
    return {"loss": loss, "ref_loss": ref_loss, "loss_diff": abs(loss - ref_loss), "grads": grads,
            "max_grad_abs_diff": grads.max_abs, "n_grads": len(grads)}


def check_step(step: dict) -> tuple[Report, ...]:
    """The rules for a :func:`step_record` (and, where recorded, the gradient norm ``norm`` /
    ``ref_norm`` and the weights after the step, ``weights``: a :class:`TrajectoryGaps`)."""
    grads = step["grads"]
    out = [check_loss(step["loss"], step["ref_loss"]), check_gradients(grads)]
    if "ref_norm" in step:
        out.append(check_norm(step["norm"], step["ref_norm"], norm_rtol(grads.steps_before, grads.optimizer)))
    if "weights" in step:
        out.append(check_trajectory(step["weights"]))
    return tuple(out)


def check_tp_results(results: list[dict]) -> None:
    """A tensor-parallel step's results, one dict per rank (``loss``, ``ref_loss``, ``rank``;
    rank 0 also ``grads``, the gathered gradients' :class:`GradientGaps`, and ``parameters``,
    the reference's count): every rank's loss and rank 0's gradients within the rules, and
    every parameter compared."""
    for r in results:
        expect(check_loss(r["loss"], r["ref_loss"]), context=r["rank"])
    expect(check_gradients(results[0]["grads"]))
    assert len(results[0]["grads"]) == results[0]["parameters"]   # every parameter compared
