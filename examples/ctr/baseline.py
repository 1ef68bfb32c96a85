"""Single-process CTR baseline: wide & deep with hashed sparse embeddings, one process, no PS.

::

    python -m examples.ctr.baseline --train 200000 --test 50000

Trains :class:`~examples.ctr.model.WideDeep` on examples ``[0, train)`` of the synthetic dataset
(:mod:`examples.ctr.data`) and evaluates on ``[train, train + test)``. The embedding tables get
sparse gradients and ``torch.optim.Adagrad`` (the classic CTR choice: a per-row learning rate
that decays with how often the row was seen); the MLP gets ``Adam``. The test AUC comes from
``fleet.metrics.AucState`` + ``auc`` (single-process here; the distributed version gets the same
number over all trainers) and is reported next to the Bayes AUC of the same test examples (the
AUC of the true probabilities, the ceiling). :func:`train_baseline` is what benchmarks call.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from examples.ctr.data import CTRBatch, CTRDataConfig, generate, roc_auc
from examples.ctr.model import DEFAULT_HASH_ROWS, WideDeep, hashed_embedding_factory
from fleet import metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """How the baseline trains and evaluates."""

    num_train: int = 200_000
    """Training examples (global indices ``[0, num_train)``)."""
    num_test: int = 50_000
    """Held-out examples right after the training ones."""
    batch_size: int = 512
    """Examples per optimiser step."""
    epochs: int = 1
    """Passes over the training examples (reshuffled after the first)."""
    embedding_dim: int = 16
    """Width of the deep embeddings."""
    hidden_dims: tuple[int, ...] = (256, 128)
    """MLP hidden layer widths."""
    hash_rows: int = DEFAULT_HASH_ROWS
    """Rows of each hashed embedding table (wide and deep)."""
    sparse_lr: float = 0.05
    """Adagrad learning rate of the embedding rows."""
    dense_lr: float = 1e-3
    """Adam learning rate of the MLP and the dense linear term."""
    seed: int = 0
    """Seed of the model's initial weights and of the shuffling."""
    num_threads: int | None = None
    """torch intra-op threads (None: torch's default)."""

    def __post_init__(self) -> None:
        for name in ("num_train", "num_test", "batch_size", "epochs", "embedding_dim", "hash_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"TrainConfig.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )
        for name in ("sparse_lr", "dense_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)!r}")


def _tensors(batch: CTRBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.from_numpy(batch.sparse_ids),
        torch.from_numpy(batch.dense),
        torch.from_numpy(batch.labels),
    )


def log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` against 0/1 ``labels``."""
    p = np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


@torch.no_grad()
def evaluate(model: WideDeep, batch: CTRBatch, batch_size: int = 8192) -> dict[str, float]:
    """Test AUC (fleet.metrics, 4096 buckets), exact AUC and log loss of ``model`` on ``batch``."""
    model.eval()
    ids, dense, _ = _tensors(batch)
    state = metrics.AucState()
    probs = np.empty(len(batch), dtype=np.float64)
    for lo in range(0, len(batch), batch_size):
        hi = min(len(batch), lo + batch_size)
        p = torch.sigmoid(model(ids[lo:hi], dense[lo:hi]))
        state.update(p, batch.labels[lo:hi])
        probs[lo:hi] = p.numpy()
    model.train()
    return {
        "auc": metrics.auc(state.stat_pos, state.stat_neg),
        "exact_auc": roc_auc(probs, batch.labels),
        "log_loss": log_loss(probs, batch.labels),
    }


def build_optimizers(model: WideDeep, train: TrainConfig) -> list[torch.optim.Optimizer]:
    """Adagrad (sparse-capable) for the embeddings, Adam for the dense parameters."""
    return [
        torch.optim.Adagrad(list(model.sparse_parameters()), lr=train.sparse_lr),
        torch.optim.Adam(list(model.dense_parameters()), lr=train.dense_lr),
    ]


def train_baseline(
    data: CTRDataConfig | None = None, train: TrainConfig | None = None
) -> dict[str, Any]:
    """Generate the data, train one process, evaluate; return the numbers as a dict.

    Keys: ``num_train``, ``num_test``, ``data_seconds`` (generation), ``train_seconds``,
    ``train_examples_per_s`` (training loop only: forward, backward, optimiser steps),
    ``test_auc`` (fleet.metrics bucketed), ``test_exact_auc``, ``bayes_auc`` (true
    probabilities, same test examples), ``test_log_loss``, ``bayes_log_loss``, ``final_train_loss``
    (mean of the last 50 steps), and the two configs.
    """
    data = data or CTRDataConfig()
    train = train or TrainConfig()
    if train.num_threads is not None:
        torch.set_num_threads(train.num_threads)
    # torch's default (no invariant checks on the optimisers' sparse tensors), said explicitly:
    # otherwise sparse Adagrad warns on every run.
    torch.sparse.check_sparse_tensor_invariants.disable()
    torch.manual_seed(train.seed)

    start = time.perf_counter()
    train_batch = generate(data, train.num_train, 0)
    test_batch = generate(data, train.num_test, train.num_train)
    data_seconds = time.perf_counter() - start
    logger.info(
        "generated %d + %d examples in %.2f s (train CTR %.3f)",
        train.num_train,
        train.num_test,
        data_seconds,
        float(train_batch.labels.mean()),
    )

    model = WideDeep(
        data.num_slots,
        data.num_dense,
        train.embedding_dim,
        train.hidden_dims,
        embedding_factory=hashed_embedding_factory(train.hash_rows),
    )
    optimizers = build_optimizers(model, train)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ids, dense, labels = _tensors(train_batch)
    generator = torch.Generator().manual_seed(train.seed)
    losses: list[float] = []

    start = time.perf_counter()
    for epoch in range(train.epochs):
        order = torch.randperm(train.num_train, generator=generator) if epoch else None
        for lo in range(0, train.num_train, train.batch_size):
            rows = (
                slice(lo, lo + train.batch_size)
                if order is None
                else order[lo : lo + train.batch_size]
            )
            loss = loss_fn(model(ids[rows], dense[rows]), labels[rows])
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            for opt in optimizers:
                opt.step()
            losses.append(loss.item())
    train_seconds = time.perf_counter() - start

    result = evaluate(model, test_batch)
    report = {
        "num_train": train.num_train,
        "num_test": train.num_test,
        "data_seconds": data_seconds,
        "train_seconds": train_seconds,
        "train_examples_per_s": train.num_train * train.epochs / train_seconds,
        "test_auc": result["auc"],
        "test_exact_auc": result["exact_auc"],
        "bayes_auc": roc_auc(test_batch.probs, test_batch.labels),
        "test_log_loss": result["log_loss"],
        "bayes_log_loss": log_loss(test_batch.probs, test_batch.labels),
        "final_train_loss": float(np.mean(losses[-50:])) if losses else math.nan,
        "data_config": asdict(data),
        "train_config": asdict(train),
    }
    logger.info(
        "trained %d examples in %.1f s (%.0f examples/s): test AUC %.4f (Bayes %.4f), "
        "log loss %.4f (Bayes %.4f)",
        train.num_train * train.epochs,
        train_seconds,
        report["train_examples_per_s"],
        report["test_auc"],
        report["bayes_auc"],
        report["test_log_loss"],
        report["bayes_log_loss"],
    )
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI: train the baseline and print its report (a table, or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--train", type=int, default=TrainConfig.num_train, help="training examples"
    )
    parser.add_argument("--test", type=int, default=TrainConfig.num_test, help="held-out examples")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--hash-rows", type=int, default=TrainConfig.hash_rows)
    parser.add_argument("--sparse-lr", type=float, default=TrainConfig.sparse_lr)
    parser.add_argument("--dense-lr", type=float, default=TrainConfig.dense_lr)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = train_baseline(
        CTRDataConfig(seed=args.seed),
        TrainConfig(
            num_train=args.train,
            num_test=args.test,
            batch_size=args.batch_size,
            epochs=args.epochs,
            hash_rows=args.hash_rows,
            sparse_lr=args.sparse_lr,
            dense_lr=args.dense_lr,
            num_threads=args.threads,
        ),
    )
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            if not key.endswith("_config"):
                print(
                    f"{key:22s} {value:.4f}" if isinstance(value, float) else f"{key:22s} {value}"
                )
    return report


if __name__ == "__main__":
    main()
