"""The GPT example as the planner takes it: ``fleetrun plan --model examples.planner.gpt:model
--sample examples.planner.gpt:sample --global_batch_size 32``.

A larger configuration than the hybrid-parallel demo's (``configs/gpt_hybrid.yaml``) so that the
matrix products, not Python, make most of a step. The sizes come from the environment
(``PLAN_GPT_HIDDEN``, ``PLAN_GPT_LAYERS``, ``PLAN_GPT_SEQ``, ``PLAN_GPT_VOCAB``,
``PLAN_GPT_HEADS``) so a test can plan a tiny one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from examples.gpt.data import MarkovTokens
from examples.gpt.model import GPTConfig, GPTLoss, gpt_layer_descs


def config() -> GPTConfig:
    """The GPT's sizes (defaults: hidden 128, 8 blocks, 4 heads, vocab 512, 64 tokens)."""
    env = os.environ.get
    return GPTConfig(
        vocab_size=int(env("PLAN_GPT_VOCAB", "512")),
        hidden_size=int(env("PLAN_GPT_HIDDEN", "128")),
        num_heads=int(env("PLAN_GPT_HEADS", "4")),
        num_layers=int(env("PLAN_GPT_LAYERS", "8")),
        max_seq_len=int(env("PLAN_GPT_SEQ", "64")),
    )


def model(mp_group: Any = None) -> tuple[list[Any], GPTLoss]:
    """The layer list (embedding, blocks, final norm, tied unembedding) and the loss."""
    return gpt_layer_descs(config(), mp_group), GPTLoss(mp_group)


def sample(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` token sequences and their next tokens."""
    cfg = config()
    return MarkovTokens(cfg.vocab_size, cfg.max_seq_len).batch(0, batch_size)


__all__ = ["config", "model", "sample"]
