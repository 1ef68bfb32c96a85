"""fleetrun's launcher: CLI, job spec, schedulers, process supervision.

Imports no torch at CLI start; talks to workers only through the env contract
(:mod:`collective.env`).
"""
