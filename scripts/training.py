"""What the training scripts share: the epoch loop and the weights file they write.

``train_iot.py`` and ``train_trades.py`` import it from this folder (they run as
``.venv/bin/python scripts/train_<workload>.py``); the random calls happen in the order the
scripts made them before, so the same seed gives the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Loss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""``loss(model, rows)``: one loss per row, shape ``(rows,)``."""


@dataclass(frozen=True)
class Schedule:
    """How :func:`fit` trains: ``epochs`` over mini-batches of ``batch_size`` rows, Adam at
    ``lr`` (``weight_decay``), the losses printed every ``report_every`` epochs."""

    epochs: int
    batch_size: int
    lr: float
    report_every: int
    weight_decay: float = 0.0


def fit(
    model: torch.nn.Module,
    train: torch.Tensor,
    val: torch.Tensor,
    loss: Loss,
    rng: np.random.Generator,
    schedule: Schedule,
) -> None:
    """Adam over shuffled mini-batches of ``train`` as ``schedule`` says; prints the mean
    train and ``val`` loss every ``report_every`` epochs and after the last; leaves ``model``
    in eval mode."""
    epochs, batch_size = schedule.epochs, schedule.batch_size
    optimiser = torch.optim.Adam(
        model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay
    )
    for epoch in range(epochs):
        model.train()
        order = torch.from_numpy(rng.permutation(len(train)))
        for start in range(0, len(train), batch_size):
            batch_loss = loss(model, train[order[start : start + batch_size]]).mean()
            optimiser.zero_grad()
            batch_loss.backward()
            optimiser.step()
        if epoch % schedule.report_every == 0 or epoch == epochs - 1:
            with torch.no_grad():
                val_loss = loss(model.eval(), val).mean()
            print(f"epoch {epoch:3d} train {batch_loss.item():.4f} val {val_loss.item():.4f}")
    model.eval()


def save_weights(
    path: Path,
    model: torch.nn.Module,
    mean: torch.Tensor,
    std: torch.Tensor,
    threshold: float,
    metrics: dict[str, float | int],
    seed: int,
    **extra: Any,
) -> None:
    """Print ``metrics`` and write the weights file the workload loads: the state dict, the
    standardisation, the threshold, the metrics, the seed, then ``extra`` (the data's source
    among them)."""
    for key, value in metrics.items():
        print(f"{key:28s} {value}")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": model.state_dict(),
            "mean": mean,
            "std": std,
            "threshold": threshold,
            "metrics": metrics,
            "seed": seed,
            **extra,
        },
        path,
    )
    print(f"wrote {path}")
