"""What ``python -m benchmarks.gpu_check`` runs and with what: the models and their batches (the
GPU sizes of the first H200 run in ``shared/validation/h200-2026-11-26``, tiny ones on a CPU), the
arms in the order they run, the packages it needs, the time budget, the children's environment.

No torch at import: the parent process never touches the device, only the arms (its child
processes) do."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the one seed of every model's initial weights (``fxpar.tracing.hf.build_model``) and of the batch
MODEL_SEED, BATCH_SEED = 0, 1234
#: plan families one GPU can run, by arm name; ``plain`` is the HF loop every other arm is held to
#: the arms of each model and precision: the plain loop first (every other arm's reference), fxpar's
#: one-GPU families, torch FSDP2 on the one rank (ZeRO-2/3's counterpart), and the plain loop and
#: data parallelism with every block compiled (inductor); ``pipeline-mask``: the pipeline fed the
#: batch with an all-ones ``attention_mask``, as a Trainer's collator gives it (traced with the
#: mask; its stages attend ``is_causal`` in an unpadded step: fxpar.tracing.graph_passes)
FAMILIES = ("plain", "dp", "zero2", "zero3", "pipeline", "pipeline-mask", "fsdp2", "plain-compiled", "dp-compiled")
#: the plan form each planned (not hand-written) fxpar arm asks ``fxpar.auto`` for
PLANNED_FORM = {"dp": "data_parallel", "pipeline": "pipeline", "pipeline-mask": "pipeline"}
#: the arms that run torch's own loops (no fxpar plan): the plain loop, FSDP2, the compiled plain loop
TORCH_FAMILIES = ("plain", "fsdp2", "plain-compiled")
MODELS = ("llama", "gpt2")
DTYPES = ("bf16", "fp32")
#: packages the check needs (the solvers, the model zoo, the HF stack, the test runner);
#: ``scs`` is optional: cvxpy must import without it (HiGHS solves every fxpar problem)
NEEDED = ("cvxpy", "highspy", "transformers", "accelerate", "pytest")
OPTIONAL = ("xdist", "pytest_timeout", "scs", "safetensors")

#: GPT-2's dropouts off: a dropout mask draws from the RNG, and two arms that draw differently
#: (a pipeline stage, a ZeRO gather) would compare different networks.  The Llama has none.
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
#: HF configs: TinyLlama's shape (1.1B) and GPT-2 124M (the config's defaults) on a GPU
GPU_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "gpt2": dict(model_type="gpt2", **NO_DROPOUT),
}
#: the same families at toy sizes (the CPU mode, and ``--tiny`` on a GPU)
TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, **NO_DROPOUT),
}
#: (samples, tokens) per global batch: the H200 run's bf16 batches; fp32 smaller (its matmuls run
#: without TF32, several times slower, and its activations take twice the memory)
GPU_BATCHES = {("llama", "bf16"): (8, 1024), ("llama", "fp32"): (2, 1024),
               ("gpt2", "bf16"): (16, 1024), ("gpt2", "fp32"): (4, 1024)}
TINY_BATCH = (4, 32)
#: wall seconds an arm is guessed to take before one of its model's arms has been timed
FIRST_GUESS_S = {"llama": 40.0, "gpt2": 25.0, "tiny": 15.0}
#: seconds guessed for the process-group part; the least worth starting the profile or the suite
#: with; what the parent keeps for itself after the suite; pytest-timeout's limit per test
NCCL_GUESS_S, PROFILE_MIN_S, SUITE_MIN_S, PARENT_MARGIN_S, PER_TEST_S = 10.0, 15.0, 30.0, 5.0, 150.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """The device and sizes of one run of the check."""

    device: str            # "cuda" or "cpu"
    tiny: bool             # toy models (always on a CPU)
    warmup: int            # untimed steps, the first of them the one whose gradients are compared
    steps: int             # timed steps (their median is the step time)

    def config(self, model: str) -> dict[str, Any]:
        return dict((TINY_CONFIGS if self.tiny else GPU_CONFIGS)[model])

    def batch(self, model: str, dtype: str) -> tuple[int, int]:
        return TINY_BATCH if self.tiny else GPU_BATCHES[(model, dtype)]


def arm_order(models: tuple[str, ...], dtypes: tuple[str, ...],
              families: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(model, dtype, family) in the order they run: bf16 first (the precision users train in),
    the Llama first in bf16 (the H200 run's model) and GPT-2 first in fp32 (the cheaper one); the
    plain loop before the fxpar arms it is compared with."""
    out = []
    for dtype in [d for d in DTYPES if d in dtypes]:
        order = MODELS if dtype == "bf16" else tuple(reversed(MODELS))
        for model in [m for m in order if m in models]:
            out += [(model, dtype, f) for f in FAMILIES if f in families]
    return out


def arm_id(model: str, dtype: str, family: str) -> str:
    return f"{model}/{dtype}/{family}"


def packages() -> dict[str, Any]:
    """Every needed and optional package: its version, or why it does not import."""
    found: dict[str, Any] = {}
    for name in NEEDED + OPTIONAL:
        dist = {"xdist": "pytest-xdist", "pytest_timeout": "pytest-timeout"}.get(name, name)
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is a missing package
            found[name] = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        found[name] = {"ok": True, "version": version}
    return found


def missing(found: dict[str, Any]) -> list[str]:
    return [name for name in NEEDED if not found[name]["ok"]]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (a child's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(port: int, cache: Path) -> dict[str, str]:
    """A one-rank process group's environment (as torchrun would set it) for a child, with the
    run's own ``XDG_CACHE_HOME`` (``cache``): the plans are priced with the catalog roofline
    whatever an earlier ``fxpar profile`` cached on this machine, and the check's own profile
    leaves nothing in the user's cache."""
    env = dict(os.environ)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
               XDG_CACHE_HOME=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def child_command(kind: str, spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu_check", "--child", kind, "--spec", str(spec_path)]


class Budget:
    """Wall seconds for the whole check: each part asks whether it still fits, and how long its
    child may run; ``reserve_s`` is kept for the test suite at the end."""

    def __init__(self, total_s: float, reserve_s: float) -> None:
        self.start = time.perf_counter()
        self.total_s, self.reserve_s = float(total_s), float(reserve_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self, *, reserved: bool = True) -> float:
        """Seconds left (before the reserve, unless ``reserved`` is False)."""
        return self.total_s - (self.reserve_s if reserved else 0.0) - self.elapsed()

    def fits(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s

    def why_not(self, what: str, estimate_s: float) -> str:
        kept = f" before the {self.reserve_s:.0f} s kept for the test suite" if self.reserve_s else ""
        return (f"budget: {max(self.left(), 0):.0f} s left{kept}, {what} needs about {estimate_s:.0f} s "
                "(raise --budget-s)")
