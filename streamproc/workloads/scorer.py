"""Shared model side of the trained anomaly workloads (iot, trades).

A checkpoint written by ``scripts/train_*.py`` holds ``state_dict``, the standardisation ``mean``
and ``std`` of the training split, the anomaly ``threshold`` and the validation ``metrics``. It is
read once per workload; ``build_model`` returns ``score (n,) float32, anomaly (n,) bool`` plus any
extra outputs of :meth:`CheckpointScorer.extra_outputs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamproc.workloads.base import ModelFn, Workload


class CheckpointScorer(Workload):
    """Base class: subclasses set ``weights`` and ``model_class`` and implement :meth:`score`."""

    weights: Path
    model_class: type[torch.nn.Module]

    def __init__(self) -> None:
        self.checkpoint: dict[str, Any] = torch.load(
            self.weights, map_location="cpu", weights_only=True
        )
        self.threshold = float(self.checkpoint["threshold"])

    def score(
        self, model: torch.nn.Module, batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        """Per-row anomaly score (n,) of a raw batch."""
        raise NotImplementedError

    def extra_outputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs appended after (score, anomaly); none by default."""
        return ()

    def load_module(self, device: torch.device) -> torch.nn.Module:
        model = self.model_class()
        model.load_state_dict(self.checkpoint["state_dict"])
        return model.eval().to(device)

    def bind_model(self, module: torch.nn.Module, device: torch.device) -> ModelFn:
        model = module
        mean = self.checkpoint["mean"].to(device)
        std = self.checkpoint["std"].to(device)
        threshold = torch.tensor(self.threshold, device=device)

        @torch.inference_mode()
        def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            score = self.score(model, batch, mean, std)
            return (score, score > threshold, *self.extra_outputs(batch))

        return run
