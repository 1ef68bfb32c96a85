"""The auto-planner: given a model, a sample batch, a global batch size and the cluster, choose
the hybrid configuration (dp x mp x pp x sharding stage, micro-batches, recompute) and say why.

Rooms, in import order (each imports only those below it):

* :mod:`fleet.planner.types`     plain data: the calibration, a candidate, an estimate, a plan
* :mod:`fleet.planner.search`    enumerate every valid candidate, refuse the others with reasons,
                                 estimate memory and step time (:mod:`fleet.planner.cost`), rank
                                 and explain; no torch (the launcher's ``fleetrun plan`` prints
                                 tables from cached calibrations without importing it)
* :mod:`fleet.planner.cache`     calibrations and plans keyed by model and cluster fingerprint
* :mod:`fleet.planner.spec`      load the user's ``module:function`` model, sample and loss
* :mod:`fleet.planner.profile`   per-layer forward/backward time, bytes, activations (torch)
* :mod:`fleet.planner.links`     alpha-beta fits of the collectives per group shape (torch)
* :mod:`fleet.planner.fsdp_probe` FSDP2's per-unit and per-parameter overhead (torch)
* :mod:`fleet.planner.calibrate` all three, inside a running job
                                 (``python -m fleet.planner.calibrate``)
* :mod:`fleet.planner.trial`     run one candidate for a few steps through the real job path
                                 (``python -m fleet.planner.trial``), timing it and its memory
* :mod:`fleet.planner.auto`      ``DistributedStrategy(auto=True)`` at ``fleet.init``
"""
