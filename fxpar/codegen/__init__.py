"""Codegen: from a traced graph and a :class:`~fxpar.plan.Plan` to this rank's ``nn.Module``.

What more than one form, or the build outside the forms, uses: the one module type
(``common``), tensor-parallel sharding (the tensor-parallel form's runtime, which the pipeline's
tensor-parallel stages use too) and cutting a model into stages (the pipeline's runtime, the
tensor-parallel form's ``--emit``, and the export cache the build and adapting keep).  Each form's
own runtime lives in its folder (``fxpar/forms/<folder>/apply_*.py``).  Inside codegen, imports go down this order only
(``tests/project/test_layers.py`` checks it):

1. ``common``   — shard marks, materialising a rank's shard, gradient buckets, gradient norms;
2. ``tensor``   — uneven tensor parallelism (``tensor.module``) and the sharding it is built
   from, also used by pipelines with tensor-parallel stages;
3. ``hand_plans``, ``sharded_plans`` — the old paths of the hand-written plans, which moved to
   :mod:`fxpar.forms.hand_plans` (until fxpar 0.3);
4. ``stages``   — cutting a model into stage modules: the export a split cuts, the split and
   what crosses its cuts;
5. ``emit`` — the per-rank files of ``fxpar emit``.

Below codegen it may import every layer of the package except the API and integrations.
"""
