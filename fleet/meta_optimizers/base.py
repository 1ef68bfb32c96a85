"""The base of fleet's optimizer wrappers: :class:`DelegatingOptimizer` is a
``torch.optim.Optimizer`` whose ``param_groups``, ``state``, ``defaults`` (and the hook tables,
and any optimizer-specific attribute) are the wrapped optimizer's own objects.

``fleet.distributed_optimizer``'s :class:`~fleet.meta_optimizers.gradient_merge.DistributedOptimizer` (gradient
merge), AMP O2's :class:`~fleet.meta_optimizers.amp.MasterWeightOptimizer` and sharding's
:class:`~fleet.meta_optimizers.sharding.ShardedOptimizer` each wrap a user's optimizer and change only what
``step`` (and a few other methods) do; everything else must be the wrapped optimizer's, so an LR
scheduler, a ``GradScaler``, a checkpoint or a step hook sees one optimizer. This class holds
that delegation once; subclasses override the methods whose behaviour they change.

It deliberately does not call ``Optimizer.__init__``: that would build a second set of
parameter groups. The hook tables (``_optimizer_step_pre_hooks``, ...) are not created either:
reads fall through ``__getattr__`` to the wrapped optimizer, so ``register_step_post_hook`` on
a wrapper registers on the optimizer that really updates.
"""

from __future__ import annotations

from typing import Any

import torch


class DelegatingOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that is a view of ``optimizer`` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__() (see the module docstring).
        self._inner = optimizer

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list object)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients through the wrapped optimizer."""
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict (interchangeable with an unwrapped one)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self._inner.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: optimizer-specific extras, the hook tables.
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


__all__ = ["DelegatingOptimizer"]
