"""What every scheduler does when a process of a PS job with automatic checkpoints dies.

Owns ``ps_policy.py`` (:class:`~launcher.recovery.ps_policy.PSRecovery`: whether to recover,
from which checkpoint, what it cost; a server or an async/half-async/GEO trainer restarted alone
or every process restarted; the :class:`~launcher.recovery.ps_policy.Recovery` lines) and
``coordinator.py`` (the trainers' :class:`~launcher.recovery.coordinator.Coordinator`: recorded
rounds and checkpoint epochs, standard library only). The local agent and the Ray driver host
both in their own process; the Kubernetes peer runs the coordinator in a pod and applies the
policy's rules from its pods. Imports no scheduler.
"""
