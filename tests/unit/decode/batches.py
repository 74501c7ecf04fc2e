"""A batch of trades records with one row of each failure kind, shared by the decoder tests."""

from __future__ import annotations

import itertools

from streamproc.records import Record, TopicPartition
from streamproc.workloads.trades import trade_messages

TP = TopicPartition("trades", 0)
ROWS = 16
"""Rows per staging slab in these tests."""


def batch() -> list[Record]:
    """12 trades records: row 3 is not JSON, row 7 is over the 4,000 bytes the tests pass
    as ``max_message_bytes``, row 9 is a tombstone; every other row decodes."""
    values = [v for _, v in itertools.islice(trade_messages(), 12)]
    values[3] = b"{not json"
    values[7] = b"x" * 5000  # over the 4,000-byte limit the tests set
    values[9] = None  # tombstone
    return [Record(TP, o, b"k", v, (), 0, 0.0, 1) for o, v in enumerate(values)]
