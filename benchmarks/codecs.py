"""CPU cost per message of the light workloads' codecs: the live ones (msgspec typed decoders,
issue 15) against a frozen copy of the ones before issue 15 (orjson + pydantic).

    .venv/bin/python benchmarks/codecs.py [--repeats 7] [--batches 10]
    .venv/bin/python benchmarks/codecs.py --smoke     # one batch, one repetition (seconds)

For trades and iot, on real messages from each workload's ``replay_messages()`` (``--batches``
batches of 256, no Kafka): ``decode_many`` into a (256, *item_shape) float32 slab, and
``encode_many`` of 256 result rows. Old and new alternate within each repetition; the cost is
thread CPU time (``time.thread_time_ns``) per message, in microseconds; printed: median and
range over the repetitions. Numbers: docs/benchmarks.md, "Codecs (issue 15)".

The old codecs (:class:`TradesCodecPre15`, :class:`IotCodecPre15`) are a frozen copy of what
``streamproc/workloads/{trades,iot}.py`` ran at commit 2f9a1f7 (the schemas, ``feature_rows``,
the per-record loops of the ``Workload`` base class, the result documents): standalone classes
that neither subclass nor call the live workloads, so a change to the live code cannot silently
change the baseline. From live code they take only the value types the result handler takes
(``Record`` in, ``Encoded`` and ``RecordError`` out) and two public helpers of
``workloads.base`` unchanged since that commit (``parse_json``, ``source_coordinates``); the
anomaly threshold is data (the shipped checkpoint's) and is passed in. Do not edit the frozen
section when the live codecs change.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal, NotRequired, Protocol

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record, TopicPartition
from streamproc.workloads import iot, trades
from streamproc.workloads.base import Encoded, parse_json, source_coordinates

ROWS = 256


class Codec(Protocol):
    """What is measured of a codec (the live workloads and the frozen copies alike)."""

    @property
    def item_shape(self) -> tuple[int, ...]: ...

    @property
    def item_dtype(self) -> np.dtype: ...

    def decode_many(
        self, records: Sequence[Record], rows: np.ndarray
    ) -> dict[int, RecordError]: ...

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]: ...


# --- frozen: the codecs at 2f9a1f7 (before issue 15); do not edit ----------------------------
INT64_MAX = 2**63 - 1
TRADES_PER_BAR = 4
FEATURES = 4
WINDOW = 32
CYCLING_CHANNELS = ("altitude", "power", "cadence", "speed")


@with_config(ConfigDict(strict=True))
class TradeMessage(TypedDict):
    """The trade message schema (strict; integers bounded to int64)."""

    trade_id: NotRequired[str | None]
    symbol: Annotated[str, Field(min_length=1)]
    ts_ms: Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)]
    price: Annotated[float, Field(gt=0)]
    size: Annotated[int, Field(gt=0, le=INT64_MAX)]
    side: Literal["buy", "sell"]
    prev_close: Annotated[float, Field(gt=0)]
    adv_20: Annotated[float, Field(gt=0)]


TRADE_MESSAGE = TypeAdapter(TradeMessage)


def feature_rows(fields: np.ndarray) -> np.ndarray:
    """(n, 5) float64 columns price, size, side (1.0 buy), prev_close, adv_20 -> (n, 4) float64
    feature rows ``[log(price/prev_close), log(size*4/adv_20), side, side*log(price/prev_close)]``.
    """
    price, size, buy, prev_close, adv_20 = fields.T
    ret = np.log(price / prev_close)
    sign = 2.0 * buy - 1.0
    return np.stack([ret, np.log(size * TRADES_PER_BAR / adv_20), sign, sign * ret], axis=1)


class TradesCodecPre15:
    """The trades codec at 2f9a1f7: pydantic ``TypeAdapter`` per message, numpy features per
    slice; encode re-parses each input with orjson to echo its fields."""

    item_shape = (FEATURES,)
    item_dtype = np.dtype(np.float32)

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        failed: dict[int, RecordError] = {}
        parsed: list[int] = []
        fields: list[tuple[float, int, bool, float, float]] = []
        for index, record in enumerate(records):
            try:
                trade = parse_json(record, TRADE_MESSAGE)
            except DecodeError as exc:
                failed[index] = exc
                continue
            parsed.append(index)
            fields.append(
                (
                    trade["price"],
                    trade["size"],
                    trade["side"] == "buy",
                    trade["prev_close"],
                    trade["adv_20"],
                )
            )
        if not fields:
            return failed
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            feats = feature_rows(np.array(fields, dtype=np.float64)).astype(rows.dtype)
        finite = np.isfinite(feats).all(axis=1)
        if not finite.all():
            for position in np.flatnonzero(~finite).tolist():
                failed[parsed[position]] = DecodeError(
                    "schema: a feature is not finite (price, size, prev_close or adv_20 out of "
                    "range)"
                )
            parsed = [i for i, ok in zip(parsed, finite.tolist(), strict=True) if ok]
            feats = feats[finite]
        if len(parsed) == len(records):
            rows[...] = feats
        else:
            rows[parsed] = feats
        return failed

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        scores, flags, feats = (out.tolist() for out in outputs)
        threshold = self.threshold
        results: list[Encoded | Exception] = []
        for record, value_score, flag, row in zip(records, scores, flags, feats, strict=True):
            try:
                head = orjson.loads(record.value or b"{}")
                value = orjson.dumps(
                    {
                        "trade_id": head.get("trade_id"),
                        "symbol": head.get("symbol"),
                        "ts_ms": head.get("ts_ms"),
                        "score": value_score,
                        "anomaly": flag,
                        "threshold": threshold,
                        "features": {
                            "log_return_vs_prev_close": row[0],
                            "log_size_vs_adv": row[1],
                            "side": int(row[2]),
                        },
                        "model": "trades autoencoder (daily OHLCV 2000-2010)",
                        "source": source_coordinates(record),
                    }
                )
            except Exception as exc:
                results.append(exc)
                continue
            results.append(Encoded(value))
        return results


class IotMessage(BaseModel):
    """The IoT message schema (a pydantic model, lax mode)."""

    device_id: str
    ts_ms: int
    window_id: int | None = None
    channels: list[str]
    window: list[list[float]]


class IotCodecPre15:
    """The IoT codec at 2f9a1f7: a pydantic model per message, decoded and encoded one record
    at a time (the ``Workload`` base class's loops); encode re-parses each input with orjson."""

    item_shape = (WINDOW, len(CYCLING_CHANNELS))
    item_dtype = np.dtype(np.float32)

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

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

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        failed: dict[int, RecordError] = {}
        for index, record in enumerate(records):  # the base class's loop: decode() per record
            try:
                self.decode(record, rows[index])
            except Exception as exc:
                known = exc if isinstance(exc, RecordError) else None
                failed[index] = known or DecodeError(f"{type(exc).__name__}: {exc}")
        return failed

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

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        results: list[Encoded | Exception] = []
        for index, record in enumerate(records):  # the base class's loop: encode() per record
            try:
                results.append(self.encode(record, tuple(out[index] for out in outputs)))
            except Exception as exc:
                results.append(exc)
        return results


# --- measurement --------------------------------------------------------------------------------


Outputs = tuple[np.ndarray, ...]


def batches(name: str, workload: Codec, count: int) -> list[tuple[list[Record], Outputs]]:
    """``count`` batches of ROWS real records and their model outputs (from the new decode)."""
    replay = trades.replay_messages if name == "trades" else iot.replay_messages
    tp = TopicPartition(name, 0)
    messages = list(itertools.islice(replay(), ROWS * count))
    out: list[tuple[list[Record], Outputs]] = []
    for start in range(0, len(messages), ROWS):
        records = [
            Record(tp, start + i, key, value, headers, 0, 0.0, 1)
            for i, (key, value, headers) in enumerate(messages[start : start + ROWS])
        ]
        rows = np.zeros((ROWS, *workload.item_shape), dtype=workload.item_dtype)
        if workload.decode_many(records, rows):
            raise SystemExit(f"{name}: a real message failed to decode")
        scores = rows.reshape(ROWS, -1)[:, 0].copy()
        outputs: Outputs = (scores, scores > np.median(scores))
        outputs += (rows,) if name == "trades" else ()
        out.append((records, outputs))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=10, help="batches of 256 messages")
    parser.add_argument("--smoke", action="store_true", help="1 batch, 1 repetition: a check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.batches = 1, 1
    live_trades, live_iot = trades.TradesWorkload(), iot.IotWorkload()
    pairs: dict[str, tuple[Codec, Codec]] = {
        "trades": (TradesCodecPre15(live_trades.threshold), live_trades),
        "iot": (IotCodecPre15(live_iot.threshold), live_iot),
    }
    print(
        f"CPU us per message (thread_time_ns), {args.batches} batches x {ROWS} real messages, "
        f"{args.repeats} repetitions alternating old/new: median [min - max]"
    )
    for name, (old, new) in pairs.items():
        data = batches(name, new, args.batches)
        slab = np.zeros((ROWS, *new.item_shape), dtype=new.item_dtype)
        stages: dict[str, Callable[[Codec], object]] = {
            "decode_many": lambda w: [w.decode_many(records, slab) for records, _ in data],  # noqa: B023
            "encode_many": lambda w: [w.encode_many(r, outputs) for r, outputs in data],  # noqa: B023
        }
        for stage, run in stages.items():
            costs = measure(run, old, new, ROWS * len(data), args.repeats)
            medians = {label: statistics.median(c) for label, c in costs.items()}
            line = "  ".join(
                f"{label} {medians[label]:6.2f} [{min(c):6.2f} - {max(c):6.2f}]"
                for label, c in costs.items()
            )
            print(f"{name:6s} {stage:11s}  {line}  old/new {medians['old'] / medians['new']:4.1f}x")


def measure(
    run: Callable[[Codec], object], old: Codec, new: Codec, messages: int, repeats: int
) -> dict[str, list[float]]:
    """CPU us per message of ``run(old)`` and ``run(new)``, alternating, after one warm-up each."""
    workloads = {"old": old, "new": new}
    for workload in workloads.values():
        run(workload)
    costs: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(repeats):
        for label, workload in workloads.items():
            started = time.thread_time_ns()
            run(workload)
            costs[label].append((time.thread_time_ns() - started) / messages / 1000)
    return costs


if __name__ == "__main__":
    main()
