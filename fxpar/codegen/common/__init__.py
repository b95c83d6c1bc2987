"""What every parallel form shares: where a shard sits in its full parameter
(``shards``), allocating a rank's shard on its device from one weight source (``materialize``),
the one module type that runs every plan (``module``) and a plan's process groups (``groups``).
Imports no other part of codegen."""
