"""Train the IoT anomaly autoencoder on the real cycling recording (bokeh-sampledata, CC0).

Reproducible: ``.venv/bin/python scripts/train_iot.py`` (seed 0, CPU, ~20 s on 2 cores) writes
``streamproc/workloads/weights/iot_autoencoder.pt`` and prints the validation metrics recorded in
docs/models.md.

Split: first 70 % of the recording (in time) for training (windows of 32 samples, stride 1),
last 30 % held out for validation (stride 1). Standardisation statistics come from the training
part only. Threshold = 99th percentile of the held-out scores.
"""

from __future__ import annotations

import numpy as np
import torch

from streamproc.workloads.iot import (
    WEIGHTS,
    WINDOW,
    SensorAutoencoder,
    reconstruction_error,
    windows,
)
from streamproc.workloads.sampledata import cycling

SEED = 0
EPOCHS = 150
TRAIN_FRACTION = 0.7


def main() -> None:
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    series = cycling()
    cut = int(len(series) * TRAIN_FRACTION)
    train = torch.from_numpy(windows(series[:cut], 1))
    val = torch.from_numpy(windows(series[cut:], 1))
    flat = torch.from_numpy(series[:cut])
    mean, std = flat.mean(dim=0), flat.std(dim=0).clamp_min(1e-3)
    model = SensorAutoencoder()
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    for epoch in range(EPOCHS):
        model.train()
        order = torch.from_numpy(rng.permutation(len(train)))
        for start in range(0, len(train), 128):
            batch = train[order[start : start + 128]]
            loss = reconstruction_error(model, batch, mean, std).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        if epoch % 25 == 0 or epoch == EPOCHS - 1:
            with torch.no_grad():
                val_loss = reconstruction_error(model.eval(), val, mean, std).mean()
            print(f"epoch {epoch:3d} train {loss.item():.4f} val {val_loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        val_scores = reconstruction_error(model, val, mean, std)
        # windows whose samples are shuffled in time: same values, broken dynamics
        shuffled = val[:, torch.from_numpy(rng.permutation(WINDOW))]
        shuffled_scores = reconstruction_error(model, shuffled, mean, std)
    threshold = float(torch.quantile(val_scores, 0.99))
    metrics = {
        "val_mse_mean": float(val_scores.mean()),
        "val_mse_median": float(val_scores.median()),
        "time_shuffled_mse_median": float(shuffled_scores.median()),
        "time_shuffled_flagged": float((shuffled_scores > threshold).float().mean()),
        "threshold_p99": threshold,
        "train_windows": len(train),
        "val_windows": len(val),
    }
    for key, value in metrics.items():
        print(f"{key:28s} {value}")
    WEIGHTS.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": model.state_dict(),
            "mean": mean,
            "std": std,
            "threshold": threshold,
            "metrics": metrics,
            "seed": SEED,
            "window": WINDOW,
            "data": "bokeh-sampledata cycling.csv.gz (CC0), first 70% train / last 30% val",
        },
        WEIGHTS,
    )
    print(f"wrote {WEIGHTS}")


if __name__ == "__main__":
    main()
