"""A toy parallel form, added to fxpar as a plug-in: every rank holds the whole model and trains
the whole global batch, so the ranks exchange nothing and each one's gradients are already
those of one process.  Never faster than data parallelism where links are fast, and the
fastest plan where links are too slow to carry the gradients.

It exists to prove that a form is its folder plus one registry line (``docs/extending.md``):
this package and ``FORM`` below, registered with ``FXPAR_FORMS=tests.toy_form``
(:mod:`fxpar.forms`); ``tests/multirank/test_toy_form.py`` runs it end to end.  Phases:
:mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.search`, :mod:`.apply`, :mod:`.predict`.
"""

from fxpar.forms import Form

#: the registry line
FORM = Form("replicated", "toy_form", "every rank trains the whole batch (a toy)", "nothing", True,
            recorded=True, package="tests.toy_form")
