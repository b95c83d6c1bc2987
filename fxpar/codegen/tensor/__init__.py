"""Uneven tensor parallelism: column/row sharding of the
projections the graph analysis found (``shard``, ``families``, ``group_norm``, ``vocab``), its
autograd collectives (``collectives``), the re-analysis of the sharded model (``verify``) and the
pass of the rank's module (``module``).  Imports ``codegen.common`` only."""
