"""Tensor parallelism read from an exported graph by dataflow, not module names: the
feature-axis dataflow (``dataflow``) and its pass over a graph (``dataflow_pass``, with the
structural rules ``structural``, joins ``join``, gated outputs ``gates``, replicated regions
``region``, parameters ``params`` and norms ``norms``), the per-block analysis (``analysis``,
with the head rows of its roles ``roles``, per-head score biases ``head_bias`` /
``head_projection`` and differential attention ``differential``); what it finds is the plan's
per-layer split, :mod:`fxpar.tensor_layers`.  Sits below the tracer (``fxpar.tracing.trace`` runs it);
imports ``fxpar.tracing``'s graph, op costs and structure modules, never the tracer itself
(``fxpar.tracing.analyze_model`` runs the analysis on a live model)."""
