"""Sharded data parallelism (ZeRO-2 / ZeRO-3, FSDP's sharding): model state divided by memory, the
batch by speed; gradients reduce-scattered, parameters all-gathered around use at stage 3. Phases:
:mod:`.spec`, :mod:`.price`, :mod:`.bound`, :mod:`.search`, :mod:`.apply`, :mod:`.predict`, :mod:`.calibrate`.
Its runtime: parameters as shards in units with their collective schedule (:mod:`.apply_units`, :mod:`.apply_schedule`), the set-up passes (:mod:`.apply_setup`), the persistent buffers (:mod:`.apply_buffers`), the dtype probe (:mod:`.apply_probe`) and the pass of the rank's module (:mod:`.apply_module`)."""
