"""What every scheduler's elastic path shares (``--nnodes MIN:MAX``): config, rendezvous, rounds.

Owns ``config.py`` (:class:`~launcher.elastic.config.ElasticConfig`, the ``elastic:`` section of
the job spec, and the torchrun / Paddle flag spellings folded into it; standard library only, so
``fleetrun --help`` and static jobs stay torch-free), ``rdzv.py`` (torch.distributed.elastic's
c10d / etcd / etcd-v2 handler, the endpoint probe, who hosts the c10d store; torch imported
inside its functions), ``membership.py`` (each round's node records and the change from the
previous round) and ``liveness.py`` (each agent's liveness socket: a refused connection proves an
agent gone, so survivors drop it without waiting for its heartbeats). The elastic agent that uses them is the local scheduler's
(:mod:`launcher.schedulers.local.elastic_agent`); the Kubernetes scheduler renders pods that run
it, the Ray scheduler forms its rounds from what Ray places.
"""
