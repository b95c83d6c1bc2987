"""Tensor parallelism: one stage over a tensor-parallel group, each layer's heads and MLP columns
divided (unevenly where the split says); the planner reaches it inside pipelines. Phases:
:mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.apply`, :mod:`.predict`, :mod:`.calibrate`.
Its runtime, which the pipeline's tensor-parallel stages share, is :mod:`fxpar.codegen.tensor`."""
