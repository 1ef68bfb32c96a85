"""Schedulers other than local: ``ray_job`` (a Ray cluster) and ``k8s_job`` (Kubernetes).

The local scheduler is ``launcher.schedulers.local.agent``; ``launcher.cli.launch`` picks one from
``JobSpec.scheduler``. Every scheduler gives its processes the same env contract
(``collective.env``) and ends a failed job with the same root-cause-first summary
(``launcher.summary``).
"""
