"""Uneven expert parallelism for mixture-of-experts models: the per-rank module (``module``).
Imports ``codegen.common`` and the hand plans (``codegen.hand_plans``)."""
