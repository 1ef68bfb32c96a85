"""The Kubernetes scheduler: a job as Kubernetes objects, and what runs inside its pods.

Owns ``scheduler.py`` (``K8sScheduler``, what the CLI calls), ``render.py`` (the job's
manifests, pure functions), ``elastic.py`` (an elastic job's NonIndexed Job and etcd),
``ps_manifest.py`` (a PS job's checkpoint volume and recovery env in the manifests),
``ps_recovery.py`` (the pods' recovery files on that volume),
``coordinator.py`` (the trainers' coordinator pod), ``client.py`` (apply, status, logs, delete,
scale through the official client; ``kubernetes`` imported lazily), ``job.py`` (render, apply,
follow, clean up) and ``pod.py`` (``fleetrun pod``, every container's command). Imports the
shared launcher modules, never the local or Ray scheduler.
"""
