"""Named RNG states for tensor-parallel regions (Paddle's ``get_rng_state_tracker``).

Under tensor parallelism some random ops must draw the *same* numbers on every model-parallel
rank (dropout on replicated activations, e.g. after a RowParallelLinear) and some *different*
ones (dropout on sharded activations, e.g. after a ColumnParallelLinear with
``gather_output=False``: each rank holds different features). :func:`model_parallel_random_seed`
seeds torch's global generator with ``seed`` on every rank (the same stream) and registers the
state :data:`MODEL_PARALLEL_RNG` seeded with ``seed + 2718 + mp_rank`` (Megatron-LM's offset, so
it never equals the global stream of rank 0); ``with get_rng_state_tracker().rng_state():`` runs
its body on that state and restores the global one afterwards, untouched.

Only torch's CPU generator is tracked (fork/restore of ``torch.get_rng_state``); CUDA generators
are not yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from collective.errors import ConfigError
from fleet.base.runtime import get_hybrid_communicate_group

MODEL_PARALLEL_RNG = "model_parallel_rng"
"""Name of the per-mp-rank state that :func:`model_parallel_random_seed` registers."""

MP_SEED_OFFSET = 2718
"""Added to the seed of the model-parallel state (Megatron-LM's value)."""


class RNGStatesTracker:
    """Named CPU generator states; :meth:`rng_state` swaps one in for a block."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every state."""
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Register state ``name`` seeded with ``seed`` (the global generator is left as it was).

        ConfigError when the name or the seed is already registered (two states on one seed
        would draw the same numbers, defeating the point)."""
        if name in self._states:
            raise ConfigError(f"RNG state {name!r} is already registered", key="name")
        if seed in self._seeds:
            raise ConfigError(f"seed {seed} is already used by another RNG state", key="seed")
        self._seeds.add(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._states[name] = torch.get_rng_state()

    def get_states_tracker(self) -> dict[str, torch.Tensor]:
        """A copy of the named states (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states_tracker(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states (from :meth:`get_states_tracker`)."""
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def rng_state(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on state ``name``; afterwards keep where it got to and restore the
        global generator exactly."""
        if name not in self._states:
            raise ConfigError(
                f"RNG state {name!r} is not registered (registered: {sorted(self._states)}); call "
                "fleet.meta_parallel.model_parallel_random_seed(seed) or tracker.add(name, seed)",
                key="name",
            )
        outer = torch.get_rng_state()
        torch.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_state_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def model_parallel_random_seed(seed: int) -> None:
    """Seed the global generator with ``seed`` (same on every rank) and register
    :data:`MODEL_PARALLEL_RNG` with ``seed + MP_SEED_OFFSET + mp_rank`` (different per mp rank).

    Needs ``fleet.init`` with ``hybrid_configs.mp_degree > 1``."""
    mp_rank = get_hybrid_communicate_group().get_model_parallel_rank()
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MP_SEED_OFFSET + mp_rank)
    torch.manual_seed(seed)


__all__ = [
    "MODEL_PARALLEL_RNG",
    "MP_SEED_OFFSET",
    "RNGStatesTracker",
    "get_rng_state_tracker",
    "model_parallel_random_seed",
]
