"""Paddle's role-maker entry point, kept for scripts that build one: ``fleet.init(role)``.

A role maker here is only a source of the :class:`~collective.env.WorkerEnv`: it reads the env
contract through :func:`collective.env.read_worker_env` (never ``os.environ`` itself) and says
whether the job is collective. The role queries live on ``fleet`` (``fleet.worker_index()``, ...)
so each concept has one name. Standard library only.
"""

from __future__ import annotations

from collective.env import WorkerEnv, read_worker_env
from collective.errors import ConfigError


class PaddleCloudRoleMaker:
    """Roles from the environment the launcher set (Paddle's ``PaddleCloudRoleMaker``).

    ``is_collective``: True for collective training, False for parameter-server mode (Paddle's
    default, which :func:`fleet.init` refuses until PS mode lands). ``env``: use this parsed
    environment instead of reading the process's own (tests, embedding).
    """

    def __init__(self, is_collective: bool = False, env: WorkerEnv | None = None) -> None:
        if not isinstance(is_collective, bool):
            raise ConfigError(f"expected True or False, got {is_collective!r}", key="is_collective")
        self.is_collective = is_collective
        self._env = env

    def worker_env(self) -> WorkerEnv:
        """The parsed env contract (read once, then cached)."""
        if self._env is None:
            self._env = read_worker_env()
        return self._env

    def __repr__(self) -> str:
        return f"PaddleCloudRoleMaker(is_collective={self.is_collective})"


__all__ = ["PaddleCloudRoleMaker"]
