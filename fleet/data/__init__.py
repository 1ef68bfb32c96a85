"""``fleet.data``: datasets for parameter-server and collective training from files.

Owns Paddle's dataset API on torch: slots, MultiSlot text parsing, ``InMemoryDataset`` /
``QueueDataset``, the data generators, global shuffle. May import :mod:`fleet.telemetry` and
:mod:`collective`; nothing else of fleet (the facade exposes its public names).
"""
