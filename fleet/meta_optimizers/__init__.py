"""``fleet.meta_optimizers``: the wrappers around the user's torch optimizer.

Owns :class:`~fleet.meta_optimizers.base.DelegatingOptimizer` (their common base), gradient merge
(:class:`~fleet.meta_optimizers.gradient_merge.DistributedOptimizer`, what
``fleet.distributed_optimizer`` returns), ZeRO sharding stages 1-3
(:mod:`~fleet.meta_optimizers.sharding`), AMP's loss scaler and O2 master weights
(:mod:`~fleet.meta_optimizers.amp`), LARS / LAMB (:mod:`~fleet.meta_optimizers.lars_lamb`),
hybrid-parallel global-norm clipping (:mod:`~fleet.meta_optimizers.clip`), and the
communication-efficient data parallel of the strategy: the DDP communication hooks and
``CommCounter`` (:mod:`~fleet.meta_optimizers.comm_hooks`), local SGD and adaptive local SGD
(:mod:`~fleet.meta_optimizers.localsgd`), Deep Gradient Compression
(:mod:`~fleet.meta_optimizers.dgc`) and 2:4 structured sparsity
(:mod:`~fleet.meta_optimizers.asp`). Which of them wrap an
optimizer, and in what order, is decided in one place: :mod:`fleet.parallelize`. Imports
:mod:`fleet.base`, :mod:`fleet.strategy`, :mod:`fleet.telemetry` and :mod:`collective` only.
Import the modules themselves (this ``__init__`` stays empty so that each loads on its own).
"""
