"""``DtypePolicy``: what a plan sends and keeps in which precision (FSDP2's vocabulary).

A plan trains in ``Plan.dtype`` (``fp32``, or ``bf16`` / ``fp16`` under autocast: matmuls in the
low precision, reductions and the loss in fp32).  Its policy says, as torch FSDP2's
``MixedPrecisionPolicy`` does, what crosses the wire:

- ``param_dtype``: the dtype parameters are all-gathered in (sharded data parallelism) and the
  forward reads them in.  ``cast`` says which parameters it applies to:

  - ``"autocast"`` (the default): only those autocast casts to the low precision anyway (the
    weights and biases of linear / matmul / convolution ops: every use of the parameter is
    autocast's cast).  Casting a shard before the all-gather instead of the full tensor after
    it is elementwise rounding either way, so the forward reads exactly the values autocast
    would have made: the step equals one process under autocast, bit for bit in the forward.
    Every other parameter (embeddings, norms, a weight also read outside a matmul, as a tied
    embedding is) is gathered in fp32.  The runtime finds the cast parameters by watching one
    forward (:mod:`fxpar.forms.sharded.apply_probe`);
  - ``"all"``: every floating parameter, as FSDP2 with ``param_dtype`` does (the fewest bytes;
    norms and embeddings then also compute in the low precision, so the step equals one process
    that runs the model with its parameters cast to ``param_dtype`` under the same autocast,
    not the fp32 model).

- ``reduce_dtype``: the dtype gradients are summed across ranks in (all-reduce, reduce-scatter);
  ``fp32`` by default, as DDP and FSDP2 with ``reduce_dtype=float32`` do.  A low-precision
  reduction halves those bytes at the cost of rounding every partial sum to it.
- ``master_dtype``: parameters as the optimizer holds them and its state: always ``fp32``.

An fp32 plan moves fp32 everywhere.  A low-precision ``param_dtype`` or ``reduce_dtype`` must
be the plan's own ``dtype`` (an fp32 plan has no autocast to say what to cast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fxpar.errors import PlanError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
CAST_RULES: tuple[str, ...] = ("autocast", "all")
CastRule = Literal["autocast", "all"]
#: bytes per element of each precision
ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class DtypePolicy:
    """What a plan sends in which precision (module docstring)."""

    #: dtype parameters are all-gathered and read in by the forward (those ``cast`` names)
    param_dtype: str = "fp32"
    #: dtype gradients are summed across ranks in
    reduce_dtype: str = "fp32"
    #: which parameters ``param_dtype`` applies to: "autocast" (those autocast casts) or "all"
    cast: CastRule = "autocast"
    #: optimizer state and master weights
    master_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in PRECISIONS:
                raise PlanError(f"dtype_policy.{name} = {value!r}: accepted values are {', '.join(PRECISIONS)}")
        if self.cast not in CAST_RULES:
            raise PlanError(f"dtype_policy.cast = {self.cast!r}: accepted values are 'autocast' (gather in "
                            "param_dtype the parameters autocast casts) and 'all' (every parameter, as FSDP2)")
        if self.master_dtype != "fp32":
            raise PlanError(f"dtype_policy.master_dtype = {self.master_dtype!r}: fxpar keeps master weights and "
                            "optimizer state in fp32; use 'fp32'")

    @classmethod
    def for_dtype(cls, dtype: str) -> DtypePolicy:
        """The default policy of a plan trained in ``dtype``: parameters gathered in ``dtype``
        (those autocast casts), gradients reduced in fp32."""
        return cls(param_dtype=dtype if dtype in PRECISIONS else "fp32")

    def check_for(self, dtype: str) -> None:
        """A PlanError unless every low precision of the policy is the plan's ``dtype``."""
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in ("fp32", dtype):
                raise PlanError(f"plan.dtype_policy.{name} = {value!r} but the plan trains in {dtype!r}: a "
                                f"low precision must be the plan's own dtype; use 'fp32' or {dtype!r}")

    @property
    def param_bytes(self) -> int:
        """Bytes per element of a parameter gathered in ``param_dtype``."""
        return ITEMSIZE[self.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of a gradient summed in ``reduce_dtype``."""
        return ITEMSIZE[self.reduce_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes per element of a master weight (what ZeRO-1 gathers after the update)."""
        return ITEMSIZE[self.master_dtype]

    def describe(self) -> str:
        """One line for ``plan.explain`` and tables."""
        which = "autocast-cast parameters" if self.cast == "autocast" else "all parameters"
        return (f"parameters gathered in {self.param_dtype} ({which}), gradients reduced in "
                f"{self.reduce_dtype}, fp32 master weights and optimizer state")

    @classmethod
    def from_value(cls, value: Any, dtype: str) -> DtypePolicy:
        """A policy from a JSON object (or a policy), its missing fields the defaults of ``dtype``."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls.for_dtype(dtype)
        if not isinstance(value, dict):
            raise PlanError(f"plan.dtype_policy = {value!r:.60}: expected an object with param_dtype, "
                            "reduce_dtype, cast, master_dtype")
        names = {"param_dtype", "reduce_dtype", "cast", "master_dtype"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise PlanError(f"plan.dtype_policy: unknown keys {unknown}; accepted keys are {sorted(names)}")
        default = cls.for_dtype(dtype)
        return cls(**{n: value.get(n, getattr(default, n)) for n in sorted(names)})


__all__ = ["CAST_RULES", "DtypePolicy", "ITEMSIZE", "PRECISIONS"]
