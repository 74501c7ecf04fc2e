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
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any, get_args

import msgspec
import numpy as np
import orjson
import torch

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Headers, Record
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.protobuf import ProtobufDecoder
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads.base import Encoded
from streamproc.workloads.codecs import (
    INT64,
    SourceCoordinates,
    StrictJsonDecoder,
    encode_one,
    encode_results,
    store_finite,
)
from streamproc.workloads.formats import StructFormats
from streamproc.workloads.iot_windows import AvroWindows, ProtobufWindows, Windows
from streamproc.workloads.registry import BUILTIN_WORKLOADS
from streamproc.workloads.sampledata import CYCLING_CHANNELS, cycling
from streamproc.workloads.schemas import iot_pb2
from streamproc.workloads.scorer import CheckpointScorer

WINDOW = 32
STRIDE = 8
DEVICES = 4
WEIGHTS = Path(__file__).parent / "weights" / "iot_autoencoder.pt"


CHANNELS = len(CYCLING_CHANNELS)
Sample = tuple[float, float, float, float]  # one value per channel (msgspec checks the length)
assert len(get_args(Sample)) == CHANNELS


class IotMessage(msgspec.Struct):
    """The IoT message schema (a message value holds one JSON object; decoded with
    :data:`IOT_MESSAGE`; other fields are allowed and ignored).

    Strict: a timestamp of ``"1"`` or ``1.0``, or a sample value of ``true`` or ``"1.5"``, is
    refused, not coerced (an integer is still a valid sample value). Integers are bounded to
    int64 (the echoed ``ts_ms`` and ``window_id`` must serialise again); a sample value beyond
    the float range (``1e999``) is refused. ``channels`` and the window length are checked by
    :meth:`IotWorkload.decode_many`.
    """

    device_id: str
    ts_ms: INT64
    channels: list[str]
    window: list[Sample]
    window_id: INT64 | None = None


class IotHead(msgspec.Struct, gc=False):
    """The fields a result echoes, read back from a window that decoded (the rest skipped)."""

    device_id: str
    ts_ms: int
    window_id: int | None = None


class IotResult(msgspec.Struct, gc=False):
    """One result document (output value, JSON, in this field order)."""

    device_id: str
    ts_ms: int
    window_id: int | None
    score: float  # reconstruction error
    anomaly: bool  # score > threshold
    threshold: float
    model: str
    source: SourceCoordinates


IOT_MESSAGE = StrictJsonDecoder(IotMessage)
IOT_HEAD = msgspec.json.Decoder(IotHead)
MODEL_NAME = "iot autoencoder (cycling recording)"
_SAMPLE_LENGTH = f"Expected `array` of length {CHANNELS} - at `$.window["


class SensorAutoencoder(torch.nn.Module):
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
    ``model``: an :class:`SensorAutoencoder`."""
    z = ((x - mean) / std).flatten(1)
    reconstruction: torch.Tensor = model(z)
    return (reconstruction - z).pow(2).mean(dim=1)


class IotWorkload(StructFormats, CheckpointScorer):
    """Score sensor windows with the trained autoencoder.

    Row: (WINDOW, 4) float32 raw sensor values in :data:`CYCLING_CHANNELS` order.
    Model outputs: score (n,) float32 and anomaly flag (n,) bool.
    """

    name = "iot"
    json_messages = IOT_MESSAGE
    json_head = IOT_HEAD
    head_schema = IotHead
    avro_reader = Path(__file__).parent / "schemas" / "iot.avsc"
    avro_result = Path(__file__).parent / "schemas" / "iot-result.avsc"
    protobuf_input = iot_pb2.SensorWindow
    protobuf_result = iot_pb2.SensorWindowResult
    result_struct = IotResult
    schema_title = "io.streamproc.iot"
    item_shape = (WINDOW, len(CYCLING_CHANNELS))
    item_dtype = np.dtype(np.float32)
    default_priority = BUILTIN_WORKLOADS[name].default_priority
    max_batch_size = BUILTIN_WORKLOADS[name].max_batch_size
    weights = WEIGHTS
    model_class = SensorAutoencoder

    straight_windows: Windows | None = None

    def use_input_format(self, name: str, writers: WriterSchemas | None) -> None:
        """As :meth:`StructFormats.use_input_format`; Avro and Protobuf windows are then read
        straight from the value's bytes in their canonical layout (:mod:`.iot_windows`)."""
        super().use_input_format(name, writers)
        general = self.messages
        self.straight_windows = None
        if isinstance(general, AvroDecoder):
            self.straight_windows = AvroWindows(general, WINDOW, CYCLING_CHANNELS, _window)
        elif isinstance(general, ProtobufDecoder):
            self.straight_windows = ProtobufWindows(general, WINDOW, CYCLING_CHANNELS, _window)

    def _store(
        self,
        parsed: list[int],
        windows: list[np.ndarray],
        failed: dict[int, RecordError],
        rows: np.ndarray,
        count: int,
    ) -> dict[int, RecordError]:
        """Windows read as arrays (Avro) into the slab, as the general way stores them."""
        _name_sample_lengths(failed)
        if not windows:
            return failed
        with np.errstate(over="ignore"):
            values = np.stack(windows).astype(rows.dtype)
        reason = "schema: window holds a non-finite value"
        return store_finite(rows, values, parsed, count, failed, reason)

    def protobuf_fields(self, message: Any) -> dict[str, Any]:
        """A ``SensorWindow`` message as the JSON message's values (``window``: one list of
        channel values per sample)."""
        return {
            "device_id": message.device_id,
            "ts_ms": message.ts_ms,
            "window_id": message.window_id if message.HasField("window_id") else None,
            "channels": list(message.channels),
            "window": [list(sample.values) for sample in message.window],
        }

    def protobuf_message(self, document: dict[str, Any]) -> Any:
        """The ``SensorWindow`` message of a JSON message (one ``Sample`` per row)."""
        samples = [iot_pb2.Sample(values=row) for row in document["window"]]
        return iot_pb2.SensorWindow(**{**document, "window": samples})

    def decode(self, record: Record, out: np.ndarray) -> None:
        failed = self.decode_many([record], out[None])
        if failed:
            raise failed[0]

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        """Decode each message (:data:`IOT_MESSAGE`), then convert every window of the slice
        with numpy: ``rows`` (len(records), WINDOW, 4) float32.

        Returns:
            Per refused index, its :class:`DecodeError` (``malformed JSON: ...``,
            ``schema: ...``, ``wrong window length: ...``, or a value beyond float32); its row
            is left unwritten.
        """
        if self.straight_windows is not None:
            return self._store(*self.straight_windows.decode_windows(records), rows, len(records))
        decoded, messages, failed = self.messages.decode_records(records)
        parsed: list[int] = []
        windows: list[list[Sample]] = []
        for index, message in zip(decoded, messages, strict=True):
            try:
                windows.append(_window(message))
            except DecodeError as exc:
                failed[index] = exc
                continue
            parsed.append(index)
        _name_sample_lengths(failed)
        if not windows:
            return failed
        flat = np.fromiter(
            chain.from_iterable(chain.from_iterable(windows)),
            np.float64,
            len(windows) * WINDOW * CHANNELS,
        )
        with np.errstate(over="ignore"):
            values = flat.reshape(len(windows), WINDOW, CHANNELS).astype(rows.dtype)
        # a finite float64 beyond float32 is inf here
        reason = "schema: window holds a non-finite value"
        return store_finite(rows, values, parsed, len(records), failed, reason)

    def score(
        self, model: torch.nn.Module, batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        return reconstruction_error(model, batch, mean, std)

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return encode_one(self.encode_many, record, outputs)

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        """One result document per window; outputs become Python numbers once per batch.

        ``outputs``: score (n,) float32, anomaly (n,) bool; each value is an
        :class:`IotResult` serialised by ``RESULT_ENCODER``. The echoed ``device_id``, ``ts_ms``
        and ``window_id`` are read back from the value with :class:`IotHead` (the window is
        skipped, not parsed); a value that does not hold them gives an :class:`EncodeError` in
        its place.
        """
        scores, flags = (out.tolist() for out in outputs)
        threshold = self.threshold

        def build(head: IotHead, record: Record, score: float, flag: bool) -> IotResult:
            return IotResult(
                head.device_id,
                head.ts_ms,
                head.window_id,
                score,
                flag,
                threshold,
                MODEL_NAME,
                SourceCoordinates.of(record),
            )

        return encode_results(
            records, zip(scores, flags, strict=True), self.read_head, build, self.encode_result
        )


def _name_sample_lengths(failed: dict[int, RecordError]) -> None:
    """Say a sample of the wrong length in the workload's words (msgspec checks the length of
    each sample tuple)."""
    for index, error in failed.items():
        if _SAMPLE_LENGTH in str(error):
            where = str(error).removeprefix("schema: ")
            failed[index] = DecodeError(f"schema: every sample needs {CHANNELS} values ({where})")


def _window(message: IotMessage) -> list[Sample]:
    """The window of a decoded message, once its channels and length are checked.

    Raises:
        DecodeError: wrong channels or window length.
    """
    if message.channels != _CHANNEL_LIST:
        raise DecodeError(f"schema: channels {message.channels}, expected {_CHANNEL_LIST}")
    if len(message.window) != WINDOW:
        raise DecodeError(f"wrong window length: {len(message.window)} samples, expected {WINDOW}")
    return message.window


_CHANNEL_LIST = list(CYCLING_CHANNELS)


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
