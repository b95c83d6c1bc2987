"""What every parallel form's module shares: where a shard sits in its full parameter
(``shards``), allocating a rank's shard on its device from one weight source (``materialize``),
and the global gradient norm (``grad_norm``).
Imports no other part of codegen."""
