"""Pipeline parallelism: the model cut into stages, each stage a tensor-parallel group on one or more
identical pipelines (or replicas of other kinds), micro-batches in a 1F1B, GPipe or interleaved
schedule. Phases: :mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.search`, :mod:`.apply`,
:mod:`.predict`."""
