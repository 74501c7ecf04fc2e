"""A workload whose decoder kills its process on a marker value (for the decode-process tests)."""

from __future__ import annotations

import os

import numpy as np

from streamproc.records import Record
from streamproc.workloads.trades import TradesWorkload


class CrashOnMarker(TradesWorkload):
    """Trades, except a value of ``b"crash"`` ends the decoding process at once."""

    def decode(self, record: Record, out: np.ndarray) -> None:
        if record.value == b"crash":
            os._exit(3)  # what a native crash in a decoder looks like from outside
        super().decode(record, out)


def make_workload() -> CrashOnMarker:
    return CrashOnMarker()
