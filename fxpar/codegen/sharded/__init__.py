"""Uneven sharded data parallelism (ZeRO-2 / ZeRO-3 with ragged shards): parameters as shards
in units with their collective schedule (``units``), the set-up passes (``setup``) and the
pass of the rank's module (``module``).  Imports ``codegen.common``."""
