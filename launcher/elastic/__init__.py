"""Elastic collective jobs (``--nnodes MIN:MAX``): the typed config and the elastic agent.

Owns ``config.py`` (:class:`~launcher.elastic.config.ElasticConfig`, the ``elastic:`` section of
the job spec, and the torchrun / Paddle flag spellings folded into it; standard library only, so
``fleetrun --help`` and static jobs stay torch-free) and the agent that runs one node of an
elastic job over torch.distributed.elastic's rendezvous handlers (c10d, etcd, etcd-v2). The
agent's modules import torch; the CLI reaches them through one function-local import.
"""
