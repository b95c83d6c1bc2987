"""Uneven data parallelism: the per-rank module (``module``).  Imports ``codegen.common`` only."""
