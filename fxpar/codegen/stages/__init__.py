"""Cutting a model into stage modules, shared by the pipeline form (its stages) and the
tensor-parallel form (its one stage): the export a split cuts (``export``, with the export cache a
running job's switches keep), the split into stage modules (``split``) and what crosses its cuts
(``boundaries``), and how the ranks of a tensor-parallel stage run a schedule together
(``tensor_stages``).  The pipeline's passes and the rest of its runtime live in its folder
(:mod:`fxpar.forms.pipeline`, ``apply_*.py``).  Imports ``codegen.common`` and the runtime."""
