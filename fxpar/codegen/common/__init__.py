"""What every parallel form's module shares: where a shard sits in its full parameter
(``shards``), allocating a rank's shard on its device from one weight source (``materialize``),
bucketed gradient all-reduce (``grad_buckets``) and the global gradient norm (``grad_norm``).
Imports no other part of codegen."""
