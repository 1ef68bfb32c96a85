"""``fleet.ps``: the trainer and server side of parameter-server training.

Owns the PS runtime (roles, starting servers, the trainer's client:
:mod:`fleet.ps.runtime`, behind ``fleet.is_server`` / ``init_worker`` / ``save_persistables`` ...),
the communicators of the four modes (sync, async, half-async, GEO: :mod:`fleet.ps.communicator`),
:class:`~fleet.ps.embedding.DistributedEmbedding` and the dense-parameter optimizer
(:mod:`fleet.ps.optimizer`). Imports :mod:`fleet.base`, :mod:`fleet.strategy`,
:mod:`fleet.telemetry`, :mod:`collective` and :mod:`ps_server`; never the collective wrappers.
``ps_server``'s gRPC side is imported only when a server or client starts, so a collective job
that asks ``in_ps_mode()`` never loads gRPC.
"""
