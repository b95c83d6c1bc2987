"""Expert parallelism: a MoE model's experts divided among the ranks (uneven counts), the rest
replicated; tokens travel to their experts by all-to-all. Phases: :mod:`.spec`, :mod:`.price`,
:mod:`.bound`, :mod:`.search`, :mod:`.apply`, :mod:`.predict`, :mod:`.calibrate`.
Its runtime: the pass (:mod:`.apply_module`) and the sharded experts it puts in each MoE block (:mod:`.apply_experts`)."""
