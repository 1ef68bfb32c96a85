"""``fleet.meta_parallel``: how a model is cut across ranks — tensor-parallel layers, the
pipeline (``PipelineLayer`` described, ``PipelineParallel`` run in 1F1B/FThenB), the model-parallel
RNG tracker, activation recompute (which replays that tracker), and batch norm synchronised over
the data-parallel replicas (:mod:`~fleet.meta_parallel.sync_batch_norm`).

Imports :mod:`fleet.base` (the hybrid groups), :mod:`fleet.strategy`, :mod:`fleet.telemetry` and
:mod:`collective`; never the optimizer wrappers, the PS side or the facade.

::

    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    fc1 = fleet.meta_parallel.ColumnParallelLinear(512, 2048, gather_output=False)
    fc2 = fleet.meta_parallel.RowParallelLinear(2048, 512, input_is_parallel=True)

See :mod:`fleet.meta_parallel.tensor_parallel` for the shard layout; pipeline parallelism is
:class:`PipelineLayer` (:mod:`~fleet.meta_parallel.pipeline_layer`) run by
:class:`PipelineParallel` (:mod:`~fleet.meta_parallel.pipeline_parallel`).
"""

from __future__ import annotations

from fleet.meta_parallel.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc
from fleet.meta_parallel.pipeline_parallel import PipelineParallel
from fleet.meta_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    get_rng_state_tracker,
    model_parallel_random_seed,
)
from fleet.meta_parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelCrossEntropy,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "LayerDesc",
    "ParallelCrossEntropy",
    "PipelineLayer",
    "PipelineParallel",
    "RNGStatesTracker",
    "RowParallelLinear",
    "SharedLayerDesc",
    "VocabParallelEmbedding",
    "get_rng_state_tracker",
    "model_parallel_random_seed",
]
