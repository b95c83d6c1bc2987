"""Pipeline parallelism: the model cut into stages, each stage a tensor-parallel group on one or more
identical pipelines (or replicas of other kinds), micro-batches in a 1F1B, GPipe or interleaved
schedule. Phases: :mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.search`, :mod:`.apply`,
:mod:`.predict`, :mod:`.calibrate`.
Its runtime beside them: the passes of the rank's module (:mod:`.apply_module`,
:mod:`.apply_interleaved`) and their shared set-up steps and batch checks (:mod:`.apply_stage_setup`,
:mod:`.apply_batches`), how the ranks of a tensor-parallel stage run its schedule together
(:mod:`.apply_tensor_stages`), stages that run a model's own modules eagerly (:mod:`.apply_eager`,
:mod:`.apply_eager_calls`), weights tied across stages (:mod:`.apply_ties`), and the gradient
exchange between pipelines (:mod:`.apply_replicas`, :mod:`.apply_replica_sum`); the cutting into stages
it shares (with the tensor-parallel form's ``--emit`` and the build's export cache) is
:mod:`fxpar.codegen.stages`."""
