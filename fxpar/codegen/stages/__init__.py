"""Cutting a model into stage modules: the export a split cuts (``export``, with the export cache
a running job's build and switches keep, :func:`fxpar.build.build_module` and :mod:`fxpar.adapt`),
the split into stage modules (``split``) and what crosses its cuts (``boundaries``).  The pipeline
form's runtime cuts its stages with it, and the tensor-parallel form's ``fxpar plan --emit`` its
one stage; the pipeline's passes and the rest of its runtime live in its folder
(:mod:`fxpar.forms.pipeline`, ``apply_*.py``).  Imports ``codegen.common`` and the layers below."""
