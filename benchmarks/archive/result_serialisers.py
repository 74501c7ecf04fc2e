"""How to serialise a trades result document: ``orjson.dumps`` of a dict against msgspec's
``Encoder`` of a dict and of a Struct (issue 15; the live codecs chose the Struct).

    .venv/bin/python benchmarks/archive/result_serialisers.py [--repeats 7] [--rounds 100]

The same document (the same JSON) is built and serialised ``--rounds`` x 256 times by each
candidate, the candidates alternating within each of ``--repeats`` repetitions; printed: CPU us
per document (``time.thread_time_ns``), median [min - max]. Numbers: docs/benchmarks.md, "Codecs
(issue 15)".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import msgspec
import orjson

ROWS = 256


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


def serialisers(repeats: int, rounds: int = 100) -> None:
    """How to serialise a result: one trades result document built and serialised ``rounds``
    x 256 times by each candidate (the same JSON), CPU us per document."""
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
            for _ in range(ROWS * rounds):
                run()
            costs[name].append((time.thread_time_ns() - started) / (ROWS * rounds) / 1000)
    for name, c in costs.items():
        spread = f"{statistics.median(c):5.2f} [{min(c):5.2f} - {max(c):5.2f}]"
        print(f"build + serialise one result: {name:31s} {spread}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=100, help="x 256 documents per repeat")
    args = parser.parse_args(argv)
    serialisers(args.repeats, args.rounds)


if __name__ == "__main__":
    main()
