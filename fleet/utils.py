"""``fleet.utils``: Paddle's ``fleet.utils`` namespace (``fleet.utils.recompute``).

Not to be confused with ``fleet.util`` (Paddle's ``UtilBase``: file shards); both exist, as in
Paddle.
"""

from __future__ import annotations

from fleet.meta_parallel.recompute import recompute

__all__ = ["recompute"]
