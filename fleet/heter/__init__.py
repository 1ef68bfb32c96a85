"""``fleet.heter``: heterogeneous parameter-server jobs, CPU trainers + heter (device) workers.

The cut is explicit: ``fleet.heter.HeterModel(cpu_part, device_part, loss_fn)``. One script runs
in every role::

    fleet.init(is_collective=False, strategy=strategy)
    model = fleet.heter.HeterModel(cpu_part, device_part, torch.nn.BCEWithLogitsLoss())
    if fleet.is_server():
        fleet.init_server(); fleet.run_server()
    elif fleet.is_heter_worker():
        fleet.run_heter_worker(model, torch.optim.Adam(model.device_part.parameters(), 1e-3))
    else:
        fleet.init_worker()
        for ids, dense, label in batches:
            loss = model.train_step((ids, dense), label)
        fleet.stop_worker()

CPU trainers run ``cpu_part`` (embeddings through ``DistributedEmbedding``) and send the
activations to heter worker ``rank mod H`` (:mod:`fleet.heter.model`); heter workers run
``device_part`` forward and backward on their device, return the activation gradients and keep
the dense parameters on the PS dense table (:mod:`fleet.heter.worker`). The transport is the
``fleetrun.ps.v1.Heter`` gRPC service (:mod:`ps_server.rpc.heter_service`). The staleness bound
is ``strategy.heter_configs = {"max_in_flight": K}`` (async; sync keeps 0). Guide:
docs/ps/heter-ps.md.
"""

from fleet.heter.model import HeterModel
from fleet.heter.worker import HETER_DENSE_TABLE, resolve_device, run_heter_worker

__all__ = ["HETER_DENSE_TABLE", "HeterModel", "resolve_device", "run_heter_worker"]
