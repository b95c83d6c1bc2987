"""Pipelines (PP, PP x TP x DP, interleaved, replicas cut differently): the export a split cuts
(``export``), the split into stage modules (``split``) and what crosses its cuts
(``boundaries``), the rank layout of tensor-parallel stages (``tensor_stages``), weights tied
across stages (``ties``), gradient exchange between pipelines with different cuts (``replicas``)
and the passes of the rank's module (``module``, ``interleaved``; their shared set-up steps and batch
checks: ``stage_setup``, ``batches``).
Imports ``codegen.common`` and ``codegen.tensor``."""
