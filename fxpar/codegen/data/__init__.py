"""Uneven data parallelism: its pass of the rank's module (``module``).  Imports ``codegen.common`` only."""
