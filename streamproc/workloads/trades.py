"""Trades workload: one trade per message -> risk/anomaly score + features.

Data: real daily OHLCV bars of AAPL, GOOG, IBM and MSFT (2000-2013, public domain, Quandl WIKI
prices) shipped in ``bokeh-sampledata``. Real intraday ticks are not available offline, so each
bar is expanded deterministically into :data:`TRADES_PER_BAR` trades: prices open, then low and
high (in the order that matches the bar's direction), then close; each trade carries a quarter
of the day's volume; side is the tick direction (the first trade against the previous close);
times are synthesised at 14:30 UTC + 0/130/260/390 minutes. Prices and volumes are real,
intra-bar timing is synthesised.

Message value (JSON)::

    {"trade_id": "AAPL-2000-03-02-1", "symbol": "AAPL", "ts_ms": 951993000000,
     "price": 127.0, "size": 694775, "side": "buy",
     "prev_close": 130.31, "adv_20": 9616100.0}

``prev_close`` and ``adv_20`` (mean daily volume of the previous 20 sessions) are the reference
fields a market-data feed carries with each trade; they make every message scorable on its own.

Model: a small MLP autoencoder over the standardised features
``[log(price/prev_close), log(size*4/adv_20), side, side*log(price/prev_close)]``, trained on
bars before 2010-07-01 (``scripts/train_trades.py``, seed 0; weights in
``weights/trades_autoencoder.pt``). Score = reconstruction error; ``anomaly`` at the 99th
percentile of held-out scores.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson
import torch

from streamproc.errors import RecordError
from streamproc.records import Headers, Record
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
from streamproc.workloads.registry import BUILTIN_WORKLOADS
from streamproc.workloads.sampledata import STOCK_SYMBOLS, Bar, stock_bars
from streamproc.workloads.schemas import trades_pb2
from streamproc.workloads.scorer import CheckpointScorer

TRADES_PER_BAR = 4
FEATURES = 4
WEIGHTS = Path(__file__).parent / "weights" / "trades_autoencoder.pt"
SPLIT_DATE = "2010-07-01"


Positive = Annotated[float, msgspec.Meta(gt=0)]
INT64_MAX = 2**63 - 1


class TradeMessage(msgspec.Struct, gc=False):
    """The trade message schema (a message value holds one JSON object; decoded with
    :data:`TRADE_MESSAGE`; other fields are allowed and ignored).

    Strict: a price of ``true`` or a timestamp of ``"1"`` is refused, not coerced (an integer
    is still a valid price; ``3.0`` is not a size). Integers are bounded to int64: the
    features are float64 and the echoed ``ts_ms`` must serialise again. Prices, size and
    ``adv_20`` are > 0 and finite (``1e999`` is refused).
    """

    symbol: Annotated[str, msgspec.Meta(min_length=1)]
    ts_ms: INT64
    price: Positive
    size: Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)]
    side: Literal["buy", "sell"]
    prev_close: Positive
    adv_20: Positive
    trade_id: str | None = None


class TradeHead(msgspec.Struct, gc=False):
    """The fields a result echoes, read back from a trade that decoded (the rest skipped)."""

    symbol: str
    ts_ms: int
    trade_id: str | None = None


class TradeFeatures(msgspec.Struct, gc=False):
    """The ``features`` of a result: from the model's raw feature row."""

    log_return_vs_prev_close: float
    log_size_vs_adv: float
    side: int  # 1 buy, -1 sell


class TradeResult(msgspec.Struct, gc=False):
    """One result document (output value, JSON, in this field order)."""

    trade_id: str | None
    symbol: str
    ts_ms: int
    score: float  # reconstruction error
    anomaly: bool  # score > threshold
    threshold: float
    features: TradeFeatures
    model: str
    source: SourceCoordinates


TRADE_MESSAGE = StrictJsonDecoder(TradeMessage)
TRADE_HEAD = msgspec.json.Decoder(TradeHead)
MODEL_NAME = "trades autoencoder (daily OHLCV 2000-2010)"


def features(price: float, size: float, side: str, prev_close: float, adv_20: float) -> list[float]:
    """The model's raw feature row (see the module docstring)."""
    ret = math.log(price / prev_close)
    sign = 1.0 if side == "buy" else -1.0
    return [ret, math.log(size * TRADES_PER_BAR / adv_20), sign, sign * ret]


def feature_rows(fields: np.ndarray) -> np.ndarray:
    """:func:`features` for many trades at once.

    Args:
        fields: (n, 5) float64 columns price, size, side (1.0 buy, 0.0 sell), prev_close,
            adv_20.

    Returns:
        (n, 4) float64 feature rows.
    """
    price, size, buy, prev_close, adv_20 = fields.T
    ret = np.log(price / prev_close)
    sign = 2.0 * buy - 1.0
    return np.stack([ret, np.log(size * TRADES_PER_BAR / adv_20), sign, sign * ret], axis=1)


class TradeAutoencoder(torch.nn.Module):
    """(n, 4) standardised features -> reconstruction (n, 4)."""

    def __init__(self, hidden: int = 16, code: int = 2) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, code),
            torch.nn.Tanh(),
            torch.nn.Linear(code, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, FEATURES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reconstruction: torch.Tensor = self.net(x)
        return reconstruction


def score(
    model: torch.nn.Module, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """Per-row mean squared reconstruction error of standardised features: (n, 4) -> (n,).
    ``model``: an :class:`TradeAutoencoder`."""
    z = (x - mean) / std
    reconstruction: torch.Tensor = model(z)
    return (reconstruction - z).pow(2).mean(dim=1)


def expand_bar(bar: Bar, prev_close: float, adv_20: float) -> list[dict[str, Any]]:
    """The deterministic trades of one daily bar (see the module docstring)."""
    middle = (bar.low, bar.high) if bar.close >= bar.open else (bar.high, bar.low)
    prices = (bar.open, *middle, bar.close)
    base = bar.volume // TRADES_PER_BAR
    sizes = [base] * (TRADES_PER_BAR - 1) + [bar.volume - base * (TRADES_PER_BAR - 1)]
    day = dt.datetime.fromisoformat(bar.date).replace(hour=14, minute=30, tzinfo=dt.UTC)
    trades = []
    last = prev_close
    for k, (price, size) in enumerate(zip(prices, sizes, strict=True)):
        side = "buy" if price >= last else "sell"
        last = price
        trades.append(
            {
                "trade_id": f"{bar.symbol}-{bar.date}-{k}",
                "symbol": bar.symbol,
                "ts_ms": int((day + dt.timedelta(minutes=130 * k)).timestamp() * 1000),
                "price": price,
                "size": max(1, size),
                "side": side,
                "prev_close": prev_close,
                "adv_20": adv_20,
            }
        )
    return trades


def all_trades(symbols: tuple[str, ...] = STOCK_SYMBOLS) -> list[dict[str, Any]]:
    """Every trade of every symbol, interleaved by time (then symbol)."""
    out = []
    for symbol in symbols:
        bars = stock_bars()[symbol]
        for i in range(1, len(bars)):
            window = bars[max(0, i - 20) : i]
            adv_20 = sum(b.volume for b in window) / len(window)
            if adv_20 <= 0 or bars[i].volume <= 0:
                continue
            out.extend(expand_bar(bars[i], bars[i - 1].close, adv_20))
    out.sort(key=lambda t: (t["ts_ms"], t["symbol"]))
    return out


class TradesWorkload(StructFormats, CheckpointScorer):
    """Score trades with the trained autoencoder.

    Row: (4,) float32 raw features. Model outputs: score (n,) float32, anomaly flag (n,) bool.
    """

    name = "trades"
    json_messages = TRADE_MESSAGE
    json_head = TRADE_HEAD
    head_schema = TradeHead
    avro_reader = Path(__file__).parent / "schemas" / "trades.avsc"
    avro_result = Path(__file__).parent / "schemas" / "trades-result.avsc"
    protobuf_input = trades_pb2.Trade
    protobuf_result = trades_pb2.TradeResult
    result_struct = TradeResult
    schema_title = "io.streamproc.trades"
    item_shape = (FEATURES,)
    item_dtype = np.dtype(np.float32)
    default_priority = BUILTIN_WORKLOADS[name].default_priority
    max_batch_size = BUILTIN_WORKLOADS[name].max_batch_size
    weights = WEIGHTS
    model_class = TradeAutoencoder
    # Measured on the 10,736 held-out trades (benchmarks/precision.py, docs/models.md): the
    # reconstruction errors this model scores (median about 1e-4) are finer than bf16's 8-bit
    # mantissa and int8's per-batch activation scale resolve.
    refused_precisions = MappingProxyType(
        {
            "bf16": "its scores lose their order at bf16 (rank correlation with fp32 0.37, "
            "320 anomaly flags changed where fp32 raises 108, on the held-out trades)",
            "int8": "dynamic int8 quantisation destroys its scores (rank correlation with fp32 "
            "0.13, 8,086 anomaly flags changed on the held-out trades)",
        }
    )

    def decode(self, record: Record, out: np.ndarray) -> None:
        failed = self.decode_many([record], out[None])
        if failed:
            raise failed[0]

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        """Decode each message (:data:`TRADE_MESSAGE`), then compute every feature row of the
        slice with numpy: ``rows`` (len(records), 4) float32, see :class:`TradesWorkload`.

        Returns:
            Per refused index, its :class:`DecodeError` (``malformed JSON: ...``,
            ``schema: ...``, or a feature that is not finite); its row is left unwritten.
        """
        parsed, trades, failed = self.messages.decode_records(records)
        if not trades:
            return failed
        fields = [(t.price, t.size, t.side == "buy", t.prev_close, t.adv_20) for t in trades]
        # np.fromiter over the flattened tuples: a third of the time of np.array(fields)
        flat = np.fromiter(chain.from_iterable(fields), np.float64, 5 * len(fields))
        columns = flat.reshape(len(fields), 5)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            feats = feature_rows(columns).astype(rows.dtype)
        # e.g. price/prev_close underflows to 0, or size/adv_20 overflows
        reason = "schema: a feature is not finite (price, size, prev_close or adv_20 out of range)"
        return store_finite(rows, feats, parsed, len(records), failed, reason)

    def score(
        self, model: torch.nn.Module, batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        return score(model, batch, mean, std)  # the module-level score()

    def extra_outputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (batch,)  # the raw features, echoed in the result

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        return encode_one(self.encode_many, record, outputs)

    def encode_many(
        self, records: Sequence[Record], outputs: tuple[np.ndarray, ...]
    ) -> list[Encoded | Exception]:
        """One result document per trade; outputs become Python numbers once per batch.

        ``outputs``: score (n,) float32, anomaly (n,) bool, features (n, 4) float32; each value
        is a :class:`TradeResult` serialised by ``RESULT_ENCODER``. The echoed
        ``trade_id``, ``symbol`` and ``ts_ms`` are read back from the value with
        :class:`TradeHead` (other fields skipped, not parsed); a value that does not hold them
        gives an :class:`EncodeError` in its place.
        """
        scores, flags, feats = (out.tolist() for out in outputs)
        threshold = self.threshold

        def build(
            head: TradeHead, record: Record, score: float, flag: bool, row: list[float]
        ) -> TradeResult:
            return TradeResult(
                head.trade_id,
                head.symbol,
                head.ts_ms,
                score,
                flag,
                threshold,
                TradeFeatures(row[0], row[1], int(row[2])),
                MODEL_NAME,
                SourceCoordinates.of(record),
            )

        rows = zip(scores, flags, feats, strict=True)
        return encode_results(records, rows, self.read_head, build, self.encode_result)


def trade_messages() -> Iterator[tuple[bytes, bytes]]:
    """Endless distinct (key=symbol, value) trade messages; looped passes get new trade ids."""
    trades = all_trades()
    loop = 0
    while True:
        for trade in trades:
            if loop:
                trade = {**trade, "trade_id": f"{trade['trade_id']}-r{loop}"}
            yield trade["symbol"].encode(), orjson.dumps(trade)
        loop += 1


def replay_messages() -> Iterator[tuple[bytes, bytes, Headers]]:
    """:func:`trade_messages` as the registry's ``(key, value, headers)`` replay stream."""
    return ((key, value, ()) for key, value in trade_messages())


def recording_size() -> int:
    """Distinct trade messages in one pass."""
    return len(all_trades())
