"""CPU cost per message of the light workloads' codecs: before issue 15 (orjson + pydantic)
against now (msgspec typed decoders, issue 15).

    .venv/bin/python benchmarks/codecs.py [--repeats 7] [--batches 10]

For trades and iot, on real messages from each workload's ``replay_messages()`` (``--batches``
batches of 256, no Kafka): ``decode_many`` into a (256, *item_shape) float32 slab, and
``encode_many`` of 256 result rows. Old and new alternate within each repetition; the cost is
thread CPU time (``time.thread_time_ns``) per message, in microseconds; printed: median and
range over the repetitions. The old codecs live only here (:class:`OldTrades`,
:class:`OldIot`: the code of ``streamproc/workloads/{trades,iot}.py`` before issue 15).
Numbers: docs/benchmarks.md, "Codecs (issue 15)".
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal, NotRequired

import msgspec
import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import TypedDict

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record, TopicPartition
from streamproc.workloads import iot, trades
from streamproc.workloads.base import Encoded, Workload, parse_json, source_coordinates
from streamproc.workloads.sampledata import CYCLING_CHANNELS

ROWS = 256
INT64_MAX = 2**63 - 1


# --- the codecs before issue 15 ----------------------------------------------------------------


@with_config(ConfigDict(strict=True))
class OldTradeMessage(TypedDict):
    trade_id: NotRequired[str | None]
    symbol: Annotated[str, Field(min_length=1)]
    ts_ms: Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX)]
    price: Annotated[float, Field(gt=0)]
    size: Annotated[int, Field(gt=0, le=INT64_MAX)]
    side: Literal["buy", "sell"]
    prev_close: Annotated[float, Field(gt=0)]
    adv_20: Annotated[float, Field(gt=0)]


OLD_TRADE_MESSAGE = TypeAdapter(OldTradeMessage)


class OldIotMessage(BaseModel):
    device_id: str
    ts_ms: int
    window_id: int | None = None
    channels: list[str]
    window: list[list[float]]


class OldTrades(trades.TradesWorkload):
    """The trades codec before issue 15 (pydantic ``TypeAdapter``; encode re-parses with orjson)."""

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        failed: dict[int, RecordError] = {}
        parsed: list[int] = []
        fields: list[tuple[float, int, bool, float, float]] = []
        for index, record in enumerate(records):
            try:
                trade = parse_json(record, OLD_TRADE_MESSAGE)
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
            feats = trades.feature_rows(np.array(fields, dtype=np.float64)).astype(rows.dtype)
        finite = np.isfinite(feats).all(axis=1)
        if not finite.all():
            for position in np.flatnonzero(~finite).tolist():
                failed[parsed[position]] = DecodeError("schema: a feature is not finite")
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


class OldIot(iot.IotWorkload):
    """The IoT codec before issue 15 (pydantic model per record; encode re-parses per record)."""

    def decode(self, record: Record, out: np.ndarray) -> None:
        message = parse_json(record, OldIotMessage)
        if tuple(message.channels) != CYCLING_CHANNELS:
            raise DecodeError(f"schema: channels {message.channels}")
        if len(message.window) != iot.WINDOW:
            raise DecodeError(f"wrong window length: {len(message.window)} samples")
        if any(len(sample) != len(CYCLING_CHANNELS) for sample in message.window):
            raise DecodeError(f"schema: every sample needs {len(CYCLING_CHANNELS)} values")
        values = np.asarray(message.window, dtype=np.float32)
        if not np.isfinite(values).all():
            raise DecodeError("schema: window holds a non-finite value")
        out[...] = values

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        return Workload.decode_many(self, records, rows)  # decode() per record

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
        return Workload.encode_many(self, records, outputs)  # encode() per record


# --- measurement --------------------------------------------------------------------------------


def batches(name: str, workload: Workload, count: int) -> list[tuple[list[Record], tuple]]:  # type: ignore[type-arg]
    """``count`` batches of ROWS real records and their model outputs (from the new decode)."""
    replay = trades.replay_messages if name == "trades" else iot.replay_messages
    tp = TopicPartition(name, 0)
    messages = list(itertools.islice(replay(), ROWS * count))
    out = []
    for start in range(0, len(messages), ROWS):
        records = [
            Record(tp, start + i, key, value, headers, 0, 0.0, 1)
            for i, (key, value, headers) in enumerate(messages[start : start + ROWS])
        ]
        rows = np.zeros((ROWS, *workload.item_shape), dtype=workload.item_dtype)
        if workload.decode_many(records, rows):
            raise SystemExit(f"{name}: a real message failed to decode")
        scores = rows.reshape(ROWS, -1)[:, 0].copy()
        outputs = (scores, scores > np.median(scores)) + ((rows,) if name == "trades" else ())
        out.append((records, outputs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=10, help="batches of 256 messages")
    args = parser.parse_args()
    pairs = {"trades": (OldTrades(), trades.TradesWorkload()), "iot": (OldIot(), iot.IotWorkload())}
    print(
        f"CPU us per message (thread_time_ns), {args.batches} batches x {ROWS} real messages, "
        f"{args.repeats} repetitions alternating old/new: median [min - max]"
    )
    for name, (old, new) in pairs.items():
        data = batches(name, new, args.batches)
        slab = np.zeros((ROWS, *new.item_shape), dtype=new.item_dtype)
        stages: dict[str, Callable[[Workload], object]] = {
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
    serializers(args.repeats)


class _Features(msgspec.Struct):
    log_return_vs_prev_close: float
    log_size_vs_adv: float
    side: int


class _Source(msgspec.Struct):
    topic: str
    partition: int
    offset: int


class _TradeResult(msgspec.Struct):
    trade_id: str | None
    symbol: str
    ts_ms: int
    score: float
    anomaly: bool
    threshold: float
    features: _Features
    model: str
    source: _Source


def serializers(repeats: int) -> None:
    """Why encode_many serialises with ``orjson.dumps``: one trades result document built and
    serialised 25,600 times by each candidate (the same JSON), CPU us per document."""
    encoder = msgspec.json.Encoder()
    tid, symbol, ts_ms, score, threshold = "AAPL-2000-03-02-1", "AAPL", 951993000000, 0.12, 0.01
    ret, size, model = 0.01234567, -0.1234567, "trades autoencoder (daily OHLCV 2000-2010)"

    def as_dict() -> dict[str, object]:
        return {
            "trade_id": tid,
            "symbol": symbol,
            "ts_ms": ts_ms,
            "score": score,
            "anomaly": False,
            "threshold": threshold,
            "features": {"log_return_vs_prev_close": ret, "log_size_vs_adv": size, "side": 1},
            "model": model,
            "source": {"topic": "trades", "partition": 0, "offset": 9},
        }

    def as_struct() -> _TradeResult:
        features = _Features(ret, size, 1)
        source = _Source("trades", 0, 9)
        return _TradeResult(tid, symbol, ts_ms, score, False, threshold, features, model, source)

    candidates: dict[str, Callable[[], bytes]] = {
        "orjson.dumps(dict)": lambda: orjson.dumps(as_dict()),
        "msgspec Encoder.encode(dict)": lambda: encoder.encode(as_dict()),
        "msgspec Encoder.encode(Struct)": lambda: encoder.encode(as_struct()),
    }
    assert len({orjson.dumps(orjson.loads(run())) for run in candidates.values()}) == 1
    costs: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, run in candidates.items():
            started = time.thread_time_ns()
            for _ in range(ROWS * 100):
                run()
            costs[name].append((time.thread_time_ns() - started) / (ROWS * 100) / 1000)
    for name, c in costs.items():
        spread = f"{statistics.median(c):5.2f} [{min(c):5.2f} - {max(c):5.2f}]"
        print(f"build + serialise one result: {name:31s} {spread}")


def measure(
    run: Callable[[Workload], object], old: Workload, new: Workload, messages: int, repeats: int
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
