"""Per-message cost of the trades codec: the per-record path against the batch path.

    .venv/bin/python benchmarks/archive/codec_costs.py

Decodes and encodes 256 real trade messages (``trade_messages()``, bokeh-sampledata bars) in one
process, no Kafka: ``Workload.decode_many`` / ``encode_many`` of the base class (one
``decode``/``encode`` call per record) against the trades workload's own batch versions. Prints
microseconds per message; the numbers behind docs/benchmarks.md ("batch codecs").
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np

from streamproc.records import Record, TopicPartition
from streamproc.workloads.base import Workload
from streamproc.workloads.trades import TradesWorkload, trade_messages

ROWS = 256


def per_message_us(run: Callable[[], object], repeats: int = 30) -> float:
    """Mean wall time of ``run`` per message, in microseconds (one warm-up call first)."""
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats / ROWS * 1e6


def main() -> None:
    workload = TradesWorkload()
    tp = TopicPartition("trades", 0)
    records = [
        Record(tp, offset, key, value, (), 0, 0.0)
        for offset, (key, value) in enumerate(itertools.islice(trade_messages(), ROWS))
    ]
    rows = np.zeros((ROWS, *workload.item_shape), dtype=workload.item_dtype)
    outputs = (rows[:, 0].copy(), rows[:, 0] > 0, rows)
    costs = {
        "decode, per record": lambda: Workload.decode_many(workload, records, rows),
        "decode, batch (decode_many)": lambda: workload.decode_many(records, rows),
        "encode, per record": lambda: Workload.encode_many(workload, records, outputs),
        "encode, batch (encode_many)": lambda: workload.encode_many(records, outputs),
    }
    for name, run in costs.items():
        print(f"{name:30s} {per_message_us(run):6.2f} us/message")


if __name__ == "__main__":
    main()
