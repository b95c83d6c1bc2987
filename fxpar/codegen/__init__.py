"""Codegen: from a traced graph and a :class:`~fxpar.plan.Plan` to this rank's ``nn.Module``.

One sub-package per parallel form, over what several forms share.  Inside codegen, imports go
down this order only (``tests/project/test_layers.py`` checks it), and two forms of one level never
import each other:

1. ``common``   — shard marks, materialising a rank's shard, gradient buckets, gradient norms;
2. ``tensor``   — uneven tensor parallelism (``tensor.module``) and the sharding it is built
   from, also used by pipelines with tensor-parallel stages;
3. ``hand_plans``, ``sharded_plans`` — the old paths of the hand-written plans, which moved to
   :mod:`fxpar.forms.hand_plans` (until fxpar 0.3);
4. ``data``, ``expert``, ``sharded``, ``pipeline`` — each form's pass of the rank's module;
5. ``emit`` — the per-rank files of ``fxpar emit``.

Below codegen it may import every layer of the package except the API and integrations.
"""
