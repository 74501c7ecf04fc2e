"""A workload that remembers which records reached its decode (the way to its model), loaded
through config like any user workload: ``tests.support.counting:make_workload``.

Only for a pipeline run in the test's own process (:data:`DECODED` is module state) with
decoding on threads or inline (``worker.decode_processes`` off, the default).
"""

from __future__ import annotations

import threading

import numpy as np

from streamproc.records import Record
from streamproc.workloads import Workload, load_workload
from tests.support.slow import _Wrapped

DECODED: set[tuple[int, int]] = set()
"""(partition, offset) of every record decoded so far (clear it before a run)."""
_LOCK = threading.Lock()


class Counting(_Wrapped):
    def decode(self, record: Record, out: np.ndarray) -> None:
        with _LOCK:
            DECODED.add((record.tp.partition, record.offset))
        self.inner.decode(record, out)


def make_workload(base: str = "trades") -> Workload:
    return Counting(load_workload(base))
