"""Memory model: bytes of model state per replica and of activations per sample.

Model state per parameter (ZeRO paper §3, reference section 3), ``Ψ`` parameters:

    optimizer   precision        weights  grads  optimizer state            total
    adam/adamw  fp32             4        4      8  (m, v)                  16 Ψ
    adam/adamw  fp16/bf16 mixed  2        2      12 (fp32 master, m, v)     16 Ψ
    sgd         fp32             4        4      4  (momentum)              12 Ψ
    sgd         fp16/bf16 mixed  2        2      8  (fp32 master, momentum) 12 Ψ

Activations: the traced graph's saved-for-backward bytes per sample (see
:mod:`fxpar.tracing.trace`), in the precision the graph was traced with.
"""

from __future__ import annotations

from fxpar.errors import ConfigError
from fxpar.workload import OPTIMIZERS

_STATE_BYTES = {  # (optimizer family, mixed precision?) -> (weights, grads, optimizer) bytes/param
    ("adam", False): (4, 4, 8),
    ("adam", True): (2, 2, 12),
    ("sgd", False): (4, 4, 4),
    ("sgd", True): (2, 2, 8),
}


def _family(optimizer: str) -> str:
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer = {optimizer!r}: accepted values are {', '.join(OPTIMIZERS)}")
    return "adam" if optimizer in ("adam", "adamw") else "sgd"


def state_bytes_per_param(optimizer: str, dtype: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter for a training precision."""
    return _STATE_BYTES[(_family(optimizer), dtype in ("fp16", "bf16"))]


def model_state_bytes(param_count: int, optimizer: str, dtype: str) -> int:
    """Weights + gradients + optimizer state of one full replica."""
    return int(param_count) * sum(state_bytes_per_param(optimizer, dtype))


def optimizer_traffic_bytes_per_param(optimizer: str, dtype: str) -> int:
    """Bytes an optimizer step reads and writes per parameter (memory-bound update).

    Adam: read weight, gradient, m, v and write weight, m, v (fp32: 16 + 12 = 28 bytes; mixed
    precision reads/writes the fp32 master instead and writes the low-precision copy: ~30).
    SGD with momentum: read weight, gradient, momentum, write weight, momentum (20 / ~22).
    """
    family = _family(optimizer)
    mixed = dtype in ("fp16", "bf16")
    if family == "adam":
        return 30 if mixed else 28
    return 22 if mixed else 20


def gradient_bytes(param_count: int, optimizer: str, dtype: str) -> int:
    """Bytes of the gradients that data parallelism all-reduces each step."""
    return int(param_count) * state_bytes_per_param(optimizer, dtype)[1]
