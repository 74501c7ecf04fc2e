"""Trades workload on real daily OHLCV bars (bokeh-sampledata), expanded into trades."""

from __future__ import annotations

import itertools

import numpy as np
import orjson
import pytest
import torch

from streamproc.errors import DecodeError
from streamproc.records import Record, TopicPartition
from streamproc.workloads.sampledata import Bar
from streamproc.workloads.trades import (
    SPLIT_DATE,
    TradesWorkload,
    all_trades,
    expand_bar,
    features,
    trade_messages,
)

TP = TopicPartition("trades", 0)


def record(value: bytes | None) -> Record:
    return Record(TP, 9, b"AAPL", value, (), 0, 0.0, 1)


@pytest.fixture(scope="module")
def workload() -> TradesWorkload:
    return TradesWorkload()


def test_bar_expansion_is_deterministic_and_keeps_real_prices_and_volume() -> None:
    bar = Bar("AAPL", "2000-03-02", 127.0, 127.94, 120.69, 122.0, 2779101)
    trades = expand_bar(bar, prev_close=130.31, adv_20=9616100.0)
    assert [t["price"] for t in trades] == [127.0, 127.94, 120.69, 122.0]  # down day: O H L C
    assert sum(t["size"] for t in trades) == bar.volume
    assert [t["side"] for t in trades] == ["sell", "buy", "sell", "buy"]
    assert len({t["ts_ms"] for t in trades}) == 4
    assert trades == expand_bar(bar, 130.31, 9616100.0)


def test_replay_loops_with_distinct_ids() -> None:
    n = len(all_trades())
    stream = trade_messages()
    first = orjson.loads(next(stream)[1])
    looped = orjson.loads(next(itertools.islice(stream, n - 1, None))[1])
    assert looped["trade_id"] == f"{first['trade_id']}-r1"
    assert looped["price"] == first["price"]


def test_decode_round_trip_and_held_out_accuracy(workload: TradesWorkload) -> None:
    split_ms = int(np.datetime64(SPLIT_DATE, "ms").astype(np.int64))
    held_out = [t for t in all_trades() if t["ts_ms"] >= split_ms]
    rows = np.zeros((len(held_out), *workload.item_shape), dtype=np.float32)
    for row, trade in enumerate(held_out):
        workload.decode(record(orjson.dumps(trade)), rows[row])
    assert rows[0].tolist() == pytest.approx(
        features(
            held_out[0]["price"],
            held_out[0]["size"],
            held_out[0]["side"],
            held_out[0]["prev_close"],
            held_out[0]["adv_20"],
        )
    )
    score, flag, feats = workload.build_model(torch.device("cpu"))(torch.from_numpy(rows))
    assert score.shape == flag.shape == (len(held_out),) and feats.shape == rows.shape
    # trades on big-move days (|return vs previous close| > 4 %) are flagged far more often
    # than others (measured 29 % vs 0.3 % for event days as defined in train_trades.py)
    big_move = np.abs(rows[:, 0]) > np.log(1.04)
    flagged = flag.numpy()
    assert big_move.sum() > 20
    assert flagged[big_move].mean() > 10 * flagged[~big_move].mean()
    assert flagged.mean() < 0.03


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "tombstone"),
        (b"", "empty"),
        (b"{not json", "malformed JSON"),
        (
            orjson.dumps(
                {
                    "symbol": "AAPL",
                    "ts_ms": 1,
                    "price": -1.0,
                    "size": 5,
                    "side": "buy",
                    "prev_close": 1.0,
                    "adv_20": 1.0,
                }
            ),
            "schema",
        ),
        (
            orjson.dumps(
                {
                    "symbol": "AAPL",
                    "ts_ms": 1,
                    "price": 1.0,
                    "size": 5,
                    "side": "hold",
                    "prev_close": 1.0,
                    "adv_20": 1.0,
                }
            ),
            "schema",
        ),
        (orjson.dumps({"symbol": "AAPL", "price": 1.0}), "schema"),
    ],
)
def test_bad_input_raises_decode_error(
    workload: TradesWorkload, value: bytes | None, reason: str
) -> None:
    out = np.zeros(workload.item_shape, dtype=np.float32)
    with pytest.raises(DecodeError, match=reason):
        workload.decode(record(value), out)


GOOD = b'"symbol": "A", "ts_ms": 1, "price": 2, "size": 3, "side": "buy", "prev_close": 1, '


@pytest.mark.parametrize(
    "value",
    [
        b"{" + GOOD + b'"adv_20": 1, "vwap": NaN}',  # accepted by pydantic's JSON parser
        b"{" + GOOD + b'"adv_20": 1, "vwap": Infinity}',
        b"{" + GOOD + b'"adv_20": 1, "note": 1e400}',
        b"{" + GOOD.replace(b'"ts_ms": 1', b'"ts_ms": 1' + b"0" * 30) + b'"adv_20": 1}',
        b"{" + GOOD.replace(b'"ts_ms": 1', b'"ts_ms": 9223372036854775808') + b'"adv_20": 1}',
        b"{" + GOOD.replace(b'"size": 3', b'"size": 1' + b"0" * 400) + b'"adv_20": 1}',
        b"{" + GOOD.replace(b'"price": 2', b'"price": true') + b'"adv_20": 1}',
        b"{" + GOOD.replace(b'"ts_ms": 1', b'"ts_ms": "1"') + b'"adv_20": 1}',
        b"{" + GOOD + b'"adv_20": "1.5"}',
        b"{" + GOOD.replace(b'"size": 3', b'"size": 3.0') + b'"adv_20": 1}',
    ],
)
def test_hostile_numbers_and_coerced_types_fail_decode(
    workload: TradesWorkload, value: bytes
) -> None:
    # Each of these was scored and then failed encode (3 tries with backoff, dead-lettered at
    # the wrong stage), raised OverflowError from decode, or was silently coerced.
    out = np.zeros(workload.item_shape, dtype=np.float32)
    with pytest.raises(DecodeError, match=r"malformed JSON|schema"):
        workload.decode(record(value), out)


def test_an_integer_price_is_still_a_price(workload: TradesWorkload) -> None:
    value = b"{" + GOOD + b'"adv_20": 1}'
    out = np.zeros(workload.item_shape, dtype=np.float32)
    workload.decode(record(value), out)
    assert out.tolist() == pytest.approx(features(2.0, 3, "buy", 1.0, 1.0), rel=1e-6)
    doc = orjson.loads(
        workload.encode(record(value), (np.float32(0.1), np.bool_(False), out)).value
    )
    assert doc["ts_ms"] == 1 and doc["symbol"] == "A"


def test_encode_carries_score_features_and_coordinates(workload: TradesWorkload) -> None:
    trade = all_trades()[0]
    feats = np.asarray(
        features(
            trade["price"], trade["size"], trade["side"], trade["prev_close"], trade["adv_20"]
        ),
        dtype=np.float32,
    )
    doc = orjson.loads(
        workload.encode(
            record(orjson.dumps(trade)), (np.float32(0.5), np.bool_(False), feats)
        ).value
    )
    assert doc["trade_id"] == trade["trade_id"] and doc["symbol"] == trade["symbol"]
    assert doc["score"] == 0.5 and doc["anomaly"] is False
    assert doc["features"]["log_return_vs_prev_close"] == pytest.approx(float(feats[0]))
    assert doc["source"] == {"topic": "trades", "partition": 0, "offset": 9}


def test_batch_codec_matches_the_per_record_path(workload: TradesWorkload) -> None:
    from streamproc.workloads import Workload

    values: list[bytes | None] = [v for _, v in itertools.islice(trade_messages(), 40)]
    values[5], values[17], values[30] = b"{not json", None, b'{"symbol": "AAPL"}'
    records = [record(v) for v in values]
    rows = np.full((len(records), *workload.item_shape), np.nan, dtype=np.float32)
    failed = workload.decode_many(records, rows)
    reference = np.full_like(rows, np.nan)
    expected = Workload.decode_many(workload, records, reference)  # decode() per record
    assert sorted(failed) == sorted(expected) == [5, 17, 30]
    assert [str(failed[i]) for i in failed] == [str(expected[i]) for i in failed]
    good = [i for i in range(len(records)) if i not in failed]
    np.testing.assert_array_equal(rows[good], reference[good])
    for i in good:  # each row is the scalar features() of its own trade
        trade = orjson.loads(values[i])  # type: ignore[arg-type]
        fields = (trade[k] for k in ("price", "size", "side", "prev_close", "adv_20"))
        assert rows[i].tolist() == pytest.approx(features(*fields), rel=1e-6)
    # encode: one batch call equals one encode() per row
    outputs = (rows[:, 0] * 2, rows[:, 0] > 0, rows)
    many = workload.encode_many([records[i] for i in good], tuple(o[good] for o in outputs))
    single = [workload.encode(records[i], tuple(o[i] for o in outputs)) for i in good]
    assert [e.value for e in many] == [e.value for e in single]  # type: ignore[union-attr]


def test_trades_whose_features_are_not_finite_are_refused(workload: TradesWorkload) -> None:
    base = {"symbol": "X", "ts_ms": 1, "size": 5, "side": "buy", "adv_20": 1.0}
    values = [
        orjson.dumps({**base, "price": 1.0, "prev_close": 1.0}),
        orjson.dumps({**base, "price": 5e-324, "prev_close": 10.0}),  # ratio underflows to 0
        b'{"symbol": "X", "ts_ms": 1, "price": 1e400, "size": 5, "side": "buy", '
        b'"prev_close": 1.0, "adv_20": 1.0}',  # parses as inf
        orjson.dumps({**base, "price": 2.0, "prev_close": 1.0}),
    ]
    rows = np.full((4, *workload.item_shape), np.nan, dtype=np.float32)
    failed = workload.decode_many([record(v) for v in values], rows)
    assert sorted(failed) == [1, 2]
    assert "not finite" in str(failed[1])
    assert "malformed JSON" in str(failed[2])  # a number beyond the float range (not inf)
    assert rows[3].tolist() == pytest.approx(features(2.0, 5, "buy", 1.0, 1.0), rel=1e-6)
    assert np.isfinite(rows[[0, 3]]).all()
