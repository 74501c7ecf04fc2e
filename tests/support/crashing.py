"""A workload whose decoder kills its process on a marker value (for the decode-process tests)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from streamproc.errors import RecordError
from streamproc.records import Record
from streamproc.workloads.trades import TradesWorkload


class CrashOnMarker(TradesWorkload):
    """Trades, except a value of ``b"crash"`` ends the decoding process at once."""

    def decode_many(self, records: Sequence[Record], rows: np.ndarray) -> dict[int, RecordError]:
        if any(record.value == b"crash" for record in records):
            os._exit(3)  # what a native crash in a decoder looks like from outside
        return super().decode_many(records, rows)


def make_workload() -> CrashOnMarker:
    return CrashOnMarker()
