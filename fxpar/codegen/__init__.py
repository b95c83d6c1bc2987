"""Codegen: from a traced graph and a :class:`~fxpar.plan.Plan` to this rank's ``nn.Module``.

What several forms' passes share: tensor-parallel sharding (the tensor-parallel form, and the
pipeline's tensor-parallel stages) and cutting a model into stages (the pipeline's stages, and the
tensor-parallel form's one stage).  Each form's own runtime lives in its folder
(``fxpar/forms/<folder>/apply_*.py``).  Inside codegen, imports go down this order only
(``tests/project/test_layers.py`` checks it):

1. ``common``   — shard marks, materialising a rank's shard, gradient buckets, gradient norms;
2. ``tensor``   — uneven tensor parallelism (``tensor.module``) and the sharding it is built
   from, also used by pipelines with tensor-parallel stages;
3. ``hand_plans``, ``sharded_plans`` — the old paths of the hand-written plans, which moved to
   :mod:`fxpar.forms.hand_plans` (until fxpar 0.3);
4. ``stages``   — cutting a model into stage modules: the export a split cuts, the split and
   what crosses its cuts, and how the ranks of a tensor-parallel stage run a schedule together;
5. ``emit`` — the per-rank files of ``fxpar emit``.

Below codegen it may import every layer of the package except the API and integrations.
"""
