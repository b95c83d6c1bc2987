"""Uneven expert parallelism for mixture-of-experts models: the pass of the rank's module (``module``) and
the sharded experts it puts in each MoE block (``experts``).
Imports ``codegen.common``."""
