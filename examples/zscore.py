"""An example user pipeline: z-score of the latest reading against its recent window.

Use it through config alone (run from the repository root, or put ``examples`` on PYTHONPATH)::

    pipelines:
      - name: temps
        input_topic: sensors.temperature
        output_topic: sensors.temperature.scored
        workload: examples.zscore:make_workload
        options: {window: 8, threshold: 3.0}

Input value: JSON ``{"sensor": "t1", "values": [21.0, 21.2, ...]}`` with ``window`` readings,
oldest first. Output value: JSON ``{"sensor", "zscore", "alert"}``: the z-score of the last
reading against the mean and standard deviation of the ones before it.
"""

from __future__ import annotations

import numpy as np
import orjson
import torch

from streamproc.errors import DecodeError
from streamproc.records import Record
from streamproc.workloads import Encoded, ModelFn, Workload


class ZScoreWorkload(Workload):
    """Row: (window,) float32 readings. Model outputs: zscore (n,) float32, alert (n,) bool."""

    name = "zscore"
    item_dtype = np.dtype(np.float32)

    def __init__(self, window: int = 8, threshold: float = 3.0) -> None:
        self.item_shape = (window,)
        self.threshold = threshold

    def decode(self, record: Record, out: np.ndarray) -> None:
        try:
            doc = orjson.loads(record.value or b"")
            values = np.asarray(doc["values"], dtype=np.float32)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DecodeError(f"expected {{'sensor', 'values'}} JSON: {exc!r}") from exc
        if values.shape != self.item_shape:
            raise DecodeError(f"expected {self.item_shape[0]} values, got {values.size}")
        out[...] = values

    def build_model(self, device: torch.device) -> ModelFn:
        threshold = self.threshold

        def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            history, last = batch[:, :-1], batch[:, -1]
            z = (last - history.mean(dim=1)) / history.std(dim=1).clamp_min(1e-6)
            return z, z.abs() > threshold

        return run

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        z, alert = outputs
        sensor = orjson.loads(record.value or b"{}").get("sensor")
        return Encoded(orjson.dumps({"sensor": sensor, "zscore": float(z), "alert": bool(alert)}))


def make_workload(window: int = 8, threshold: float = 3.0) -> ZScoreWorkload:
    """Factory named in config as ``examples.zscore:make_workload``."""
    return ZScoreWorkload(window, threshold)
