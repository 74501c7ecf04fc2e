"""The light workloads' typed JSON codecs (msgspec, issue 15): what they refuse and why, and that
real messages decode and encode to what independent code computes from them."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest

from streamproc.errors import DecodeError
from streamproc.records import Record, TopicPartition
from streamproc.workloads import iot, trades
from streamproc.workloads.iot import WINDOW, IotWorkload
from streamproc.workloads.trades import TradesWorkload

TP = TopicPartition("codecs", 3)
REAL = 2000


def record(value: bytes | None, offset: int = 7) -> Record:
    return Record(TP, offset, b"k", value, (), 0, 0.0, 1)


@pytest.fixture(scope="module")
def trades_workload() -> TradesWorkload:
    return TradesWorkload()


@pytest.fixture(scope="module")
def iot_workload() -> IotWorkload:
    return IotWorkload()


def decoded(workload: TradesWorkload | IotWorkload, value: bytes) -> np.ndarray:
    out = np.full(workload.item_shape, np.nan, dtype=np.float32)
    workload.decode(record(value), out)
    return out


# --- trades ------------------------------------------------------------------------------------

FIELDS = {
    "symbol": b'"A"',
    "ts_ms": b"1",
    "price": b"2",
    "size": b"3",
    "side": b'"buy"',
    "prev_close": b"1",
    "adv_20": b"1",
}


def trade(extra: bytes = b"", **raw: bytes) -> bytes:
    """A trade message with some fields' raw JSON text replaced (``b""`` drops the field)."""
    fields = {**FIELDS, **raw}
    body = b", ".join(b'"%s": %s' % (k.encode(), v) for k, v in fields.items() if v)
    return b"{" + body + extra + b"}"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (trade(price=b"NaN"), r"^malformed JSON: invalid character"),
        (trade(price=b"Infinity"), r"^malformed JSON: invalid character"),
        (trade(price=b"-Infinity"), r"^malformed JSON"),
        (trade(price=b"1e999"), r"^malformed JSON: number beyond the float range - at `\$\.price`"),
        (
            trade(adv_20=b"1" + b"0" * 400 + b".0"),
            r"^malformed JSON: number beyond the float range",
        ),
        # msgspec skips fields the schema does not name without checking them; orjson does
        (trade(b', "vwap": NaN'), r"^malformed JSON"),
        (trade(b', "note": 1e400'), r"^malformed JSON: number is infinity"),
        (trade(b', "note": -1e999'), r"^malformed JSON: number is infinity"),
        (trade(b', "note": 1' + b"0" * 400), r"^malformed JSON: number is infinity"),
        (trade(b', "note": "\xff"'), r"^malformed JSON: str is not valid UTF-8"),
        (trade(b', "note": "\\ud800"'), r"^malformed JSON"),
        (trade(b', "note": ' + b"[" * 5000 + b"]" * 5000), r"^malformed JSON"),
        (trade(symbol=b'"\xff"'), r"^malformed JSON"),
        (trade(price=b"02"), r"^malformed JSON"),
        (trade(price=b"+2"), r"^malformed JSON"),
        (trade(b", "), r"^malformed JSON: trailing comma"),
        (trade() + b" x", r"^malformed JSON: trailing characters"),
        (trade() + b"{}", r"^malformed JSON: trailing characters"),
        (trade() + b"\x00", r"^malformed JSON: trailing characters"),
        (b"\xef\xbb\xbf" + trade(), r"^malformed JSON"),
        (b"{not json", r"^malformed JSON"),
        (trade()[:-3], r"^malformed JSON"),
        (
            trade(ts_ms=b"9223372036854775808"),
            r"^schema: Expected `int` <= 9223372036854775807 - at `\$\.ts_ms`",
        ),
        (trade(ts_ms=b"-9223372036854775808"), r"^schema: .* at `\$\.ts_ms`"),
        (trade(ts_ms=b"1" + b"0" * 30), r"^schema: .* at `\$\.ts_ms`"),
        (trade(size=b"9223372036854775808"), r"^schema: .* at `\$\.size`"),
        (trade(size=b"1" + b"0" * 400), r"^schema: .* at `\$\.size`"),
        (trade(price=b"true"), r"^schema: Expected `float`, got `bool` - at `\$\.price`"),
        (trade(price=b'"2"'), r"^schema: Expected `float`, got `str` - at `\$\.price`"),
        (trade(price=b"null"), r"^schema: .* at `\$\.price`"),
        (trade(ts_ms=b'"1"'), r"^schema: Expected `int`, got `str` - at `\$\.ts_ms`"),
        (trade(ts_ms=b"1.0"), r"^schema: Expected `int`, got `float` - at `\$\.ts_ms`"),
        (trade(size=b"3.0"), r"^schema: Expected `int`, got `float` - at `\$\.size`"),
        (trade(size=b"true"), r"^schema: Expected `int`, got `bool` - at `\$\.size`"),
        (trade(adv_20=b'"1.5"'), r"^schema: Expected `float`, got `str` - at `\$\.adv_20`"),
        (trade(price=b"0"), r"^schema: Expected `float` > 0.0 - at `\$\.price`"),
        (trade(price=b"-1.0"), r"^schema: .* at `\$\.price`"),
        (trade(price=b"1e-400"), r"^schema: .* at `\$\.price`"),  # parses as 0.0
        (trade(size=b"0"), r"^schema: .* at `\$\.size`"),
        (trade(prev_close=b"-2"), r"^schema: .* at `\$\.prev_close`"),
        (trade(symbol=b'""'), r"^schema: .* at `\$\.symbol`"),
        (trade(symbol=b"5"), r"^schema: .* at `\$\.symbol`"),
        (trade(side=b'"hold"'), r"^schema: Invalid enum value 'hold' - at `\$\.side`"),
        (trade(side=b'"BUY"'), r"^schema: .* at `\$\.side`"),
        (trade(side=b"1"), r"^schema: .* at `\$\.side`"),
        (trade(b', "trade_id": 5'), r"^schema: .* at `\$\.trade_id`"),
        (trade(ts_ms=b""), r"^schema: Object missing required field `ts_ms`"),
        (trade(adv_20=b""), r"^schema: Object missing required field `adv_20`"),
        (b"[1, 2]", r"^schema: Expected `object`, got `array`"),
        (b"null", r"^schema"),
        (trade(price=b"5e-324", prev_close=b"10"), r"^schema: a feature is not finite"),
        (None, r"^tombstone"),
        (b"", r"^empty"),
    ],
)
def test_trades_refuses_with_the_reason(
    trades_workload: TradesWorkload, value: bytes | None, reason: str
) -> None:
    out = np.zeros(trades_workload.item_shape, dtype=np.float32)
    with pytest.raises(DecodeError, match=reason):
        trades_workload.decode(record(value), out)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (trade(), 3),
        (trade(b', "trade_id": null'), 3),
        (trade(b', "trade_id": "t-1"'), 3),
        (trade(b', "vwap": 1.5, "venue": {"mic": ["XNAS", 1e-400, 12345678901234567890123]}'), 3),
        (trade() + b" \n", 3),
        (b" \t" + trade(), 3),
        (trade(ts_ms=b"-9223372036854775807", size=b"9223372036854775807"), 2**63 - 1),
        (trade(price=b"2.0e0"), 3),
        (trade(b', "price": 2'), 3),  # a repeated key: the last one counts (as orjson)
    ],
)
def test_trades_accepts_valid_json_an_integer_price_and_extra_fields(
    trades_workload: TradesWorkload, value: bytes, size: int
) -> None:
    ret = np.log(2.0)
    expected = [ret, np.log(size * 4 / 1.0), 1.0, ret]
    assert decoded(trades_workload, value).tolist() == pytest.approx(expected, rel=1e-6)


def independent_trade_rows(values: list[bytes]) -> np.ndarray:
    """The feature rows of trades.py's docstring, from the stdlib JSON parser."""
    docs = [json.loads(v) for v in values]
    col = {k: np.array([d[k] for d in docs], dtype=np.float64) for k in ("price", "size")}
    prev_close = np.array([d["prev_close"] for d in docs], dtype=np.float64)
    adv_20 = np.array([d["adv_20"] for d in docs], dtype=np.float64)
    sign = np.array([1.0 if d["side"] == "buy" else -1.0 for d in docs])
    ret = np.log(col["price"] / prev_close)
    rows = np.stack([ret, np.log(col["size"] * 4 / adv_20), sign, sign * ret], axis=1)
    return rows.astype(np.float32)


def test_real_trades_decode_to_the_frozen_feature_rows(trades_workload: TradesWorkload) -> None:
    values = [v for _, v, _ in itertools.islice(trades.replay_messages(), REAL)]
    rows = np.full((REAL, *trades_workload.item_shape), np.nan, dtype=np.float32)
    assert trades_workload.decode_many([record(v) for v in values], rows) == {}
    np.testing.assert_array_equal(rows, independent_trade_rows(values))
    # Frozen from the orjson + pydantic decoder before issue 15 on the same 2,000 messages
    # (bit-identical rows then; sums, not bytes, because np.log may differ by an ulp elsewhere).
    sums = rows.astype(np.float64).sum(axis=0).tolist()
    assert sums == pytest.approx(
        [-7.513951846456621, -100.13236663525458, 74.0, 18.260584094095975], rel=1e-7
    )


def test_real_trades_encode_echoes_their_fields(trades_workload: TradesWorkload) -> None:
    values = [v for _, v, _ in itertools.islice(trades.replay_messages(), 256)]
    records = [record(v, offset) for offset, v in enumerate(values)]
    rows = independent_trade_rows(values)
    scores = np.linspace(0, 1, len(values), dtype=np.float32)
    flags = scores > 0.9
    encoded = trades_workload.encode_many(records, (scores, flags, rows))
    for offset, (value, result) in enumerate(zip(values, encoded, strict=True)):
        assert not isinstance(result, Exception)
        source = json.loads(value)
        assert json.loads(result.value) == {
            "trade_id": source["trade_id"],
            "symbol": source["symbol"],
            "ts_ms": source["ts_ms"],
            "score": float(scores[offset]),
            "anomaly": bool(flags[offset]),
            "threshold": trades_workload.threshold,
            "features": {
                "log_return_vs_prev_close": float(rows[offset, 0]),
                "log_size_vs_adv": float(rows[offset, 1]),
                "side": int(rows[offset, 2]),
            },
            "model": "trades autoencoder (daily OHLCV 2000-2010)",
            "source": {"topic": "codecs", "partition": 3, "offset": offset},
        }


def test_trades_encode_of_an_unreadable_value_is_an_encode_error(
    trades_workload: TradesWorkload,
) -> None:
    outputs = (np.zeros(2, np.float32), np.zeros(2, bool), np.zeros((2, 4), np.float32))
    results = trades_workload.encode_many([record(b"{}"), record(trade())], outputs)
    assert isinstance(results[0], Exception) and results[0].stage == "encode"  # type: ignore[attr-defined]
    assert "ts_ms" in str(results[0]) or "symbol" in str(results[0])
    assert not isinstance(results[1], Exception)


# --- iot ---------------------------------------------------------------------------------------

CHANNELS = b'["altitude", "power", "cadence", "speed"]'


def window(sample: bytes = b"[1.5, 2, 3, 4]", at: int = 0, count: int = WINDOW) -> bytes:
    samples = [b"[1.5, 2, 3, 4]"] * count
    if count:
        samples[at] = sample
    return b"[" + b", ".join(samples) + b"]"


def reading(extra: bytes = b"", **raw: bytes) -> bytes:
    fields = {"device_id": b'"d"', "ts_ms": b"1", "channels": CHANNELS, "window": window()}
    fields.update(raw)
    body = b", ".join(b'"%s": %s' % (k.encode(), v) for k, v in fields.items() if v)
    return b"{" + body + extra + b"}"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (reading(window=window(b"[1, NaN, 3, 4]")), r"^malformed JSON: invalid character"),
        (reading(window=window(b"[1, Infinity, 3, 4]")), r"^malformed JSON"),
        (
            reading(window=window(b"[1, 1e999, 3, 4]", 3)),
            r"^malformed JSON: number beyond the float range - at `\$\.window\[3\]\[1\]`",
        ),
        (reading(window=window(b"[1, 1e300, 3, 4]")), r"^schema: window holds a non-finite value"),
        (reading(b', "note": 1e400'), r"^malformed JSON: number is infinity"),
        (reading(b', "note": "\xff"'), r"^malformed JSON"),
        (reading() + b"]", r"^malformed JSON: trailing characters"),
        (b'{"device_id": "d", "ts_ms": 1, ', r"^malformed JSON"),
        (reading(ts_ms=b'"1"'), r"^schema: Expected `int`, got `str` - at `\$\.ts_ms`"),
        (reading(ts_ms=b"1.0"), r"^schema: Expected `int`, got `float` - at `\$\.ts_ms`"),
        (reading(ts_ms=b"true"), r"^schema: .* at `\$\.ts_ms`"),
        (
            reading(ts_ms=b"9223372036854775808"),
            r"^schema: .* <= 9223372036854775807 - at `\$\.ts_ms`",
        ),
        (reading(b', "window_id": 1.0'), r"^schema: .* at `\$\.window_id`"),
        (reading(b', "window_id": 9223372036854775808'), r"^schema: .* at `\$\.window_id`"),
        (reading(device_id=b"5"), r"^schema: .* at `\$\.device_id`"),
        (
            reading(window=window(b'[1, "2.5", 3, 4]')),
            r"^schema: .* got `str` - at `\$\.window\[0\]\[1\]`",
        ),
        (
            reading(window=window(b"[1, true, 3, 4]")),
            r"^schema: .* got `bool` - at `\$\.window\[0\]\[1\]`",
        ),
        (reading(window=window(b"[1, null, 3, 4]")), r"^schema: .* at `\$\.window\[0\]\[1\]`"),
        (
            reading(window=window(b"[1, 2, 3]", 5)),
            r"^schema: every sample needs 4 values .*`\$\.window\[5\]`",
        ),
        (reading(window=window(b"[1, 2, 3, 4, 5]")), r"^schema: every sample needs 4 values"),
        (reading(window=window(b"1")), r"^schema: .* at `\$\.window\[0\]`"),
        (reading(window=window(count=WINDOW - 1)), r"^wrong window length: 31 samples"),
        (reading(window=window(count=WINDOW + 1)), r"^wrong window length: 33 samples"),
        (reading(window=b"[]"), r"^wrong window length: 0 samples"),
        (reading(channels=b'["a", "b", "c", "d"]'), r"^schema: channels \['a', 'b', 'c', 'd'\]"),
        (reading(channels=b""), r"^schema: Object missing required field `channels`"),
        (b'{"device_id": "d", "channels": [], "window": []}', r"^schema: .*`ts_ms`"),
        (None, r"^tombstone"),
        (b"", r"^empty"),
    ],
)
def test_iot_refuses_with_the_reason(
    iot_workload: IotWorkload, value: bytes | None, reason: str
) -> None:
    out = np.zeros(iot_workload.item_shape, dtype=np.float32)
    with pytest.raises(DecodeError, match=reason):
        iot_workload.decode(record(value), out)


@pytest.mark.parametrize(
    "value",
    [
        reading(),
        reading(b', "window_id": null'),
        reading(b', "window_id": 17, "firmware": {"v": [1, 2e-400]}'),
        reading(ts_ms=b"-9223372036854775807"),
    ],
)
def test_iot_accepts_valid_json_integer_values_and_extra_fields(
    iot_workload: IotWorkload, value: bytes
) -> None:
    row = decoded(iot_workload, value)
    np.testing.assert_array_equal(row, np.tile(np.float32([1.5, 2, 3, 4]), (WINDOW, 1)))


def real_iot_values(count: int) -> list[bytes]:
    return [v for _, v, _ in itertools.islice(iot.replay_messages(), count)]


def test_real_iot_windows_decode_to_the_frozen_rows(iot_workload: IotWorkload) -> None:
    values = real_iot_values(REAL)
    rows = np.full((REAL, *iot_workload.item_shape), np.nan, dtype=np.float32)
    assert iot_workload.decode_many([record(v) for v in values], rows) == {}
    independent = np.array([json.loads(v)["window"] for v in values], dtype=np.float32)
    np.testing.assert_array_equal(rows, independent)
    # frozen from the orjson + pydantic decoder before issue 15 on the same 2,000 messages
    digest = "062cd416344b35c10a1b86419430852479dbfb93da1014aa8968643cf6c46490"
    assert hashlib.sha256(rows.tobytes()).hexdigest() == digest


def test_iot_batch_with_bad_rows_writes_only_the_good_ones(iot_workload: IotWorkload) -> None:
    values: list[bytes | None] = list(real_iot_values(12))
    values[2], values[5], values[9] = None, reading(ts_ms=b'"1"'), b"{"
    rows = np.full((len(values), *iot_workload.item_shape), np.nan, dtype=np.float32)
    failed = iot_workload.decode_many([record(v) for v in values], rows)
    assert sorted(failed) == [2, 5, 9]
    good = [i for i in range(len(values)) if i not in failed]
    independent = np.array([json.loads(values[i])["window"] for i in good], dtype=np.float32)  # type: ignore[arg-type]
    np.testing.assert_array_equal(rows[good], independent)
    assert np.isnan(rows[[2, 5, 9]]).all()


def test_real_iot_encode_echoes_their_fields(iot_workload: IotWorkload) -> None:
    values = real_iot_values(256)
    records = [record(v, offset) for offset, v in enumerate(values)]
    scores = np.linspace(0, 2, len(values), dtype=np.float32)
    flags = scores > 1.5
    encoded = iot_workload.encode_many(records, (scores, flags))
    for offset, (value, result) in enumerate(zip(values, encoded, strict=True)):
        assert not isinstance(result, Exception)
        source = json.loads(value)
        assert json.loads(result.value) == {
            "device_id": source["device_id"],
            "ts_ms": source["ts_ms"],
            "window_id": source["window_id"],
            "score": float(scores[offset]),
            "anomaly": bool(flags[offset]),
            "threshold": iot_workload.threshold,
            "model": "iot autoencoder (cycling recording)",
            "source": {"topic": "codecs", "partition": 3, "offset": offset},
        }
    single = iot_workload.encode(records[3], (scores[3], flags[3]))
    assert single.value == encoded[3].value  # type: ignore[union-attr]
