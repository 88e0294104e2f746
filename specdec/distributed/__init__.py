"""Tensor parallelism over ``torch.distributed``: the rank group and the collectives the sharded
layers issue (:mod:`~specdec.distributed.parallel_state`) and the per-step broadcast that keeps every
rank's engine in lockstep (:mod:`~specdec.distributed.step_sync`). The sharded layers are
:mod:`specdec.models.parallel`; the worker processes are started by :mod:`specdec.engine.workers`."""
