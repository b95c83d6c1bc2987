"""fxpar: automatic parallelization of PyTorch / HuggingFace training on heterogeneous GPUs.

    model = fxpar.auto(model, cluster, example_inputs, global_batch=...)   # or config=fxpar.Options(...)

Pipeline: tracing (torch.export) -> profiling (cost model) -> solvers (cvxpy) -> codegen.
"""

from fxpar.api import ParallelModule, auto, from_pretrained, make_plan
from fxpar.cluster import Cluster
from fxpar.errors import ConfigError, FxparError, InfeasibleError, PlanError, TraceError
from fxpar.options import Options
from fxpar.plan import Plan
from fxpar.predict import Prediction, predict
from fxpar.runtime.contract import make_optimizer
from fxpar.workload import Workload

__version__ = "0.1.0"

__all__ = ["make_optimizer", "Cluster", "ConfigError", "FxparError", "InfeasibleError", "Options", "ParallelModule", "Plan",
           "PlanError", "Prediction", "TraceError", "Workload", "auto", "from_pretrained", "make_plan", "predict", "__version__"]
