"""Data parallelism: every rank holds the whole model and trains its own share of the batch (uneven
shares by speed); gradients are all-reduced. Phases: :mod:`.spec`, :mod:`.price`, :mod:`.bound`,
:mod:`.search`, :mod:`.apply`, :mod:`.predict`, :mod:`.calibrate` (:mod:`fxpar.forms` says what each does).
The pass itself is :mod:`.apply_module` (``DataParallel``)."""
