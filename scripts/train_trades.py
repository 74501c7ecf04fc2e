"""Train the trades anomaly autoencoder on real daily OHLCV bars (bokeh-sampledata, public
domain), expanded into trades as streamproc's replay does.

Reproducible: ``.venv/bin/python scripts/train_trades.py`` (seed 0, CPU) writes
``streamproc/workloads/weights/trades_autoencoder.pt`` and prints the metrics recorded in
docs/models.md.

Split by time: trades before 2010-07-01 train, trades from 2010-07-01 on are held out.
Threshold = 99th percentile of held-out scores. Validation metric: ROC AUC of the score for
telling trades on event days (|close/prev_close - 1| > 4 % or volume > 3x adv_20) from the rest,
on the held-out period.
"""

from __future__ import annotations

import numpy as np
import torch
from training import Schedule, fit, save_weights

from streamproc.workloads.trades import (
    SPLIT_DATE,
    WEIGHTS,
    TradeAutoencoder,
    all_trades,
    features,
    score,
)

SEED = 0
SCHEDULE = Schedule(epochs=40, batch_size=256, lr=3e-3, report_every=10)
DATA = "bokeh-sampledata stocks.csv.gz (public domain), AAPL GOOG IBM MSFT"


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve via the rank-sum (Mann-Whitney U) statistic."""
    order = scores.argsort()
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def main() -> None:
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    trades = all_trades()
    x = np.array(
        [features(t["price"], t["size"], t["side"], t["prev_close"], t["adv_20"]) for t in trades],
        dtype=np.float32,
    )
    split_ms = int(np.datetime64(SPLIT_DATE, "ms").astype(np.int64))
    is_train = np.array([t["ts_ms"] < split_ms for t in trades])
    # event days: the day's close moved > 4 % or its volume was > 3x the 20-day average
    close_of_day: dict[str, float] = {}
    for t in trades:
        close_of_day[t["trade_id"].rsplit("-", 1)[0]] = t["price"]  # last trade = close
    event = np.array(
        [
            abs(close_of_day[t["trade_id"].rsplit("-", 1)[0]] / t["prev_close"] - 1) > 0.04
            or t["size"] * 4 > 3 * t["adv_20"]
            for t in trades
        ]
    )
    train = torch.from_numpy(x[is_train])
    val = torch.from_numpy(x[~is_train])
    mean, std = train.mean(dim=0), train.std(dim=0).clamp_min(1e-3)
    model = TradeAutoencoder()
    fit(model, train, val, lambda m, rows: score(m, rows, mean, std), rng, SCHEDULE)
    with torch.no_grad():
        val_scores = score(model, val, mean, std).numpy()
    threshold = float(np.quantile(val_scores, 0.99))
    val_event = event[~is_train]
    metrics = {
        "val_mse_mean": float(val_scores.mean()),
        "val_event_day_roc_auc": roc_auc(val_scores, val_event),
        "val_event_trades": int(val_event.sum()),
        "val_flagged_on_event_days": float((val_scores[val_event] > threshold).mean()),
        "val_flagged_on_other_days": float((val_scores[~val_event] > threshold).mean()),
        "threshold_p99": threshold,
        "train_trades": int(is_train.sum()),
        "val_trades": int((~is_train).sum()),
    }
    save_weights(
        WEIGHTS, model, mean, std, threshold, metrics, SEED, split_date=SPLIT_DATE, data=DATA
    )


if __name__ == "__main__":
    main()
