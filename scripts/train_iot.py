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
from training import Schedule, fit, save_weights

from streamproc.workloads.iot import (
    WEIGHTS,
    WINDOW,
    SensorAutoencoder,
    reconstruction_error,
    windows,
)
from streamproc.workloads.sampledata import cycling

SEED = 0
SCHEDULE = Schedule(epochs=150, batch_size=128, lr=1e-3, report_every=25, weight_decay=1e-5)
DATA = "bokeh-sampledata cycling.csv.gz (CC0), first 70% train / last 30% val"
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
    fit(model, train, val, lambda m, rows: reconstruction_error(m, rows, mean, std), rng, SCHEDULE)
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
    save_weights(WEIGHTS, model, mean, std, threshold, metrics, SEED, window=WINDOW, data=DATA)


if __name__ == "__main__":
    main()
