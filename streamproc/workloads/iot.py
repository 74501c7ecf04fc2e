"""IoT workload: windows of multichannel sensor samples -> anomaly score + flag.

Data: the real 1 Hz bike-computer recording shipped in ``bokeh-sampledata`` (``cycling.csv.gz``,
CC0; 4,391 samples of altitude m, power W, cadence rpm, speed m/s). The replay cuts it into
windows of :data:`WINDOW` samples (stride :data:`STRIDE`) and sends each quarter of the recording
as one device (``bike-q0`` .. ``bike-q3``), so windows spread over partitions like several
devices would.

Message value (JSON)::

    {"device_id": "bike-q1", "ts_ms": 1700000000000, "window_id": 17,
     "channels": ["altitude", "power", "cadence", "speed"],
     "window": [[12.8, 68.0, 5.0, 1.621], ...]}        # WINDOW rows x 4 channels

Model: a small MLP autoencoder trained on the first 70 % of the recording (``scripts/train_iot.py``,
seed 0; weights in ``weights/iot_autoencoder.pt``, ~40 KB). The score is the mean squared
reconstruction error of the standardised window; ``anomaly`` is ``score > threshold``, the
threshold being the 99th percentile of the scores on the held-out last 30 %.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import torch
from pydantic import BaseModel

from streamproc.errors import DecodeError
from streamproc.records import Headers, Record
from streamproc.workloads.base import Encoded, parse_json, source_coordinates
from streamproc.workloads.registry import BUILTIN_WORKLOADS
from streamproc.workloads.sampledata import CYCLING_CHANNELS, cycling
from streamproc.workloads.scorer import CheckpointScorer

WINDOW = 32
STRIDE = 8
DEVICES = 4
WEIGHTS = Path(__file__).parent / "weights" / "iot_autoencoder.pt"


class IotMessage(BaseModel):
    """The IoT message schema (validated with pydantic)."""

    device_id: str
    ts_ms: int
    window_id: int | None = None
    channels: list[str]
    window: list[list[float]]


class Autoencoder(torch.nn.Module):
    """MLP autoencoder over a flattened standardised window: (n, WINDOW*4) -> same shape."""

    def __init__(
        self, inputs: int = WINDOW * len(CYCLING_CHANNELS), hidden: int = 64, code: int = 12
    ) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, code)
        )
        self.decoder = torch.nn.Sequential(
            torch.nn.ReLU(),
            torch.nn.Linear(code, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, inputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reconstruction: torch.Tensor = self.decoder(self.encoder(x))
        return reconstruction


def windows(series: np.ndarray, stride: int) -> np.ndarray:
    """All windows of :data:`WINDOW` rows: (count, WINDOW, channels), float32."""
    count = (len(series) - WINDOW) // stride + 1
    index = np.arange(WINDOW)[None, :] + stride * np.arange(count)[:, None]
    return np.asarray(series[index], dtype=np.float32)


def reconstruction_error(
    model: torch.nn.Module, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """Per-window mean squared error of standardised windows: (n, WINDOW, C) -> (n,).
    ``model``: an :class:`Autoencoder`."""
    z = ((x - mean) / std).flatten(1)
    reconstruction: torch.Tensor = model(z)
    return (reconstruction - z).pow(2).mean(dim=1)


class IotWorkload(CheckpointScorer):
    """Score sensor windows with the trained autoencoder.

    Row: (WINDOW, 4) float32 raw sensor values in :data:`CYCLING_CHANNELS` order.
    Model outputs: score (n,) float32 and anomaly flag (n,) bool.
    """

    name = "iot"
    item_shape = (WINDOW, len(CYCLING_CHANNELS))
    item_dtype = np.dtype(np.float32)
    default_priority = BUILTIN_WORKLOADS[name].default_priority
    weights = WEIGHTS
    model_class = Autoencoder

    def decode(self, record: Record, out: np.ndarray) -> None:
        message = parse_json(record, IotMessage)
        if tuple(message.channels) != CYCLING_CHANNELS:
            raise DecodeError(
                f"schema: channels {message.channels}, expected {list(CYCLING_CHANNELS)}"
            )
        if len(message.window) != WINDOW:
            raise DecodeError(
                f"wrong window length: {len(message.window)} samples, expected {WINDOW}"
            )
        if any(len(sample) != len(CYCLING_CHANNELS) for sample in message.window):
            raise DecodeError(f"schema: every sample needs {len(CYCLING_CHANNELS)} values")
        values = np.asarray(message.window, dtype=np.float32)
        if not np.isfinite(values).all():
            raise DecodeError("schema: window holds a non-finite value")
        out[...] = values

    def score(
        self, model: torch.nn.Module, batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        return reconstruction_error(model, batch, mean, std)

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        score, flag = outputs
        try:
            head = orjson.loads(record.value or b"{}")
        except orjson.JSONDecodeError:
            head = {}
        value = orjson.dumps(
            {
                "device_id": head.get("device_id"),
                "ts_ms": head.get("ts_ms"),
                "window_id": head.get("window_id"),
                "score": float(score),
                "anomaly": bool(flag),
                "threshold": self.threshold,
                "model": "iot autoencoder (cycling recording)",
                "source": source_coordinates(record),
            }
        )
        return Encoded(value)


def iot_messages() -> Iterator[tuple[bytes, bytes]]:
    """Endless distinct (key, value) IoT messages; window ids continue across loops."""
    series = cycling()
    quarter = len(series) // DEVICES
    per_device = [windows(series[q * quarter : (q + 1) * quarter], STRIDE) for q in range(DEVICES)]
    loop = 0
    while True:
        for index in range(max(len(w) for w in per_device)):
            for device, device_windows in enumerate(per_device):
                if index >= len(device_windows):
                    continue
                device_id = f"bike-q{device}"
                window_id = index + loop * len(device_windows)
                value = orjson.dumps(
                    {
                        "device_id": device_id,
                        "ts_ms": int(time.time() * 1000),
                        "window_id": window_id,
                        "channels": list(CYCLING_CHANNELS),
                        "window": np.round(device_windows[index].astype(np.float64), 3).tolist(),
                    }
                )
                yield device_id.encode(), value
        loop += 1


def replay_messages() -> Iterator[tuple[bytes, bytes, Headers]]:
    """:func:`iot_messages` as the registry's ``(key, value, headers)`` replay stream."""
    return ((key, value, ()) for key, value in iot_messages())


def recording_size() -> int:
    """Distinct IoT messages in one pass."""
    quarter = len(cycling()) // DEVICES
    return DEVICES * ((quarter - WINDOW) // STRIDE + 1)
