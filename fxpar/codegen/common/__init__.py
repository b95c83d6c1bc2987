"""What every parallel form's module shares: where a shard sits in its full parameter
(``shards``), allocating a rank's shard on its device from one weight source (``materialize``),
the base of every form's module (``module``) and a plan's process groups (``groups``).
Imports no other part of codegen."""
