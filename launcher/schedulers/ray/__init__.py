"""The Ray scheduler: a job as Ray actors in a placement group, supervised by the driver.

Owns ``scheduler.py`` (``RayScheduler``, what the CLI calls), ``cluster.py`` (connect to or
start a Ray cluster; ``ray`` imported lazily), ``plan.py`` (slots and every process's env from
where the actors landed; no ray import), ``actor.py`` (the actor that runs one process on its
node), ``job.py`` (the driver's attempt loop), ``start.py`` (one attempt's placement group,
actors and processes), ``watch.py`` (one attempt's output, exits and teardown), ``members.py``
(what the driver holds of an attempt), ``elastic.py`` (elastic rounds from what Ray places, the
growth probe) and ``ps_recovery.py`` (a PS process's actor re-created alone in its bundle).
Imports the shared launcher modules, never the local or Kubernetes scheduler.
"""
