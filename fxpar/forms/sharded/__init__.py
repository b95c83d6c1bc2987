"""Sharded data parallelism (ZeRO-2 / ZeRO-3, FSDP's sharding): model state divided by memory, the
batch by speed; gradients reduce-scattered, parameters all-gathered around use at stage 3. Phases:
:mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.search`, :mod:`.apply`, :mod:`.predict`."""
