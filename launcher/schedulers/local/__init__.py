"""The local scheduler: fleetrun runs this node's processes itself, one fleetrun per node.

Owns ``scheduler.py`` (``LocalScheduler``, what the CLI calls), ``launch.py`` (where this node
sits in the job, the configuration table, the job files), ``plan.py`` (this node's process specs
per attempt: collective trainers, PS servers and trainers), ``agent.py`` (the attempt loop:
start, watch, restart or fail, a PS process recovered alone) and the elastic path for
``--nnodes MIN:MAX``: ``elastic_launch.py`` (the rendezvous handler and who hosts the c10d
store) and ``elastic_agent.py`` (the round loop over torch's rendezvous; torch is imported on
this path only). Imports the shared launcher modules, never the Ray or Kubernetes scheduler.
"""
