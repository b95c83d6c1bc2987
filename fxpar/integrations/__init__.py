"""Integrations: HF Trainer (:mod:`.trainer`) and Accelerate (:mod:`.accelerate`).

Both read an ``fxpar.yaml`` (:mod:`.config`) and share :func:`parallelize`; importing this
package does not import transformers or accelerate."""

from fxpar.integrations.common import parallelize
from fxpar.integrations.config import (
    FxparConfig,
    RebalanceConfig,
    config_from_mapping,
    load_config,
)

__all__ = ["FxparConfig", "RebalanceConfig", "config_from_mapping", "load_config", "parallelize"]
