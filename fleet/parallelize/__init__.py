"""``fleet.parallelize``: the composition — from a strategy to wrapped models and optimizers.

Owns ``fleet.distributed_model`` (:mod:`~fleet.parallelize.model`),
``fleet.distributed_optimizer`` (:mod:`~fleet.parallelize.optimizer`), the one function that
applies every wrapper in a fixed order (:func:`~fleet.parallelize.compose.parallelize`), the
per-model and per-optimizer strategy features (:mod:`~fleet.parallelize.features`: sync batch
norm, ASP pruning, recompute, AMP, LARS/LAMB, clipping) and torch DDP with gradient merge
(:class:`~fleet.parallelize.data_parallel.DataParallel`). The only subpackage that may import
both :mod:`fleet.meta_parallel` and :mod:`fleet.meta_optimizers` (and :mod:`fleet.ps`, to leave a
PS job's model alone); nothing below imports it.
"""

from fleet.parallelize.compose import parallelize

# ``from fleet.parallelize import check_composition, sharding_stage`` (their home before the
# split): they are strategy checks and live in fleet.strategy now.
from fleet.strategy.composition import check_composition, sharding_stage, uses_pipeline

__all__ = ["check_composition", "parallelize", "sharding_stage", "uses_pipeline"]
