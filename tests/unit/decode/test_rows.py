"""Row helpers: oversized values, slices, and decode_rows' runs and fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from streamproc.decode.rows import decode_rows, oversized, row_slices
from streamproc.errors import DecodeError, RegistryUnavailable
from streamproc.records import Record
from tests.unit.decode.batches import TP, batch


class _Recorder:
    """A workload stub that records the runs decode_rows hands to decode_many."""

    item_shape = (1,)

    def __init__(self, broken: bool = False, answer: object = None) -> None:
        self.runs: list[list[int]] = []
        self.broken = broken
        self.answer = answer  # returned instead of the real failures when not None

    def decode(self, record: Record, out: np.ndarray) -> None:
        out[0] = record.offset

    def decode_many(self, records: list[Record], rows: np.ndarray) -> dict:  # type: ignore[type-arg]
        self.runs.append([r.offset for r in records])
        if self.broken:
            raise RuntimeError("workload bug")
        if self.answer is not None:
            return self.answer  # type: ignore[return-value]
        for index, record in enumerate(records):
            self.decode(record, rows[index])
        return {1: DecodeError("second of the run")} if len(records) > 1 else {}


def test_decode_rows_calls_decode_many_per_run_between_skipped_rows() -> None:
    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 16)]
    rows = np.full((8, 1), -1.0)
    workload = _Recorder()
    # rows 2..7 of the slab; rows 4 and 5 were refused up front (oversized)
    failed = decode_rows(workload, records, rows, 2, {4: DecodeError("big"), 5: DecodeError("big")})  # type: ignore[arg-type]
    assert workload.runs == [[10, 11], [14, 15]]
    assert sorted(failed) == [3, 7]  # index 1 of each run, counted in slab rows
    assert rows[:, 0].tolist() == [-1, -1, 10, 11, -1, -1, 14, 15]
    # a decode_many that raises: its run is decoded record by record, nothing is lost
    broken = _Recorder(broken=True)
    rows[:] = -1
    assert decode_rows(broken, records, rows, 2, {}) == {}  # type: ignore[arg-type]
    assert rows[2:, 0].tolist() == [10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize(
    "answer",
    [
        [],  # not a dict
        {7: DecodeError("row 7 of a 6-row run")},  # would fail another slice's row
        {-1: DecodeError("negative")},
        {0: ValueError("not a RecordError")},  # the result handler reads error.stage
        {"0": DecodeError("string key")},
        {True: DecodeError("bool key")},
    ],
)
def test_a_wrong_answer_from_decode_many_falls_back_per_record(answer: object) -> None:
    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 16)]
    rows = np.full((6, 1), -1.0)
    # the stub writes nothing before answering: a row left unwritten would be scored on stale
    # data unless the run is decoded again
    assert decode_rows(_Recorder(answer=answer), records, rows, 0, {}) == {}  # type: ignore[arg-type]
    assert rows[:, 0].tolist() == [10, 11, 12, 13, 14, 15]


def test_numpy_integer_rows_from_decode_many_are_accepted() -> None:
    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 13)]
    rows = np.full((3, 1), -1.0)
    failed = decode_rows(_Recorder(answer={np.int64(1): DecodeError("x")}), records, rows, 0, {})  # type: ignore[arg-type]
    assert failed.keys() == {1} and type(next(iter(failed))) is int
    assert rows[:, 0].tolist() == [-1, -1, -1]  # the stub's answer was taken: no fallback


def test_oversized_values_fail_by_row_without_decoding_and_tombstones_pass() -> None:
    failed = oversized(batch(), 4000)
    assert list(failed) == [7]  # row 9, a tombstone (no value), is not oversized
    assert isinstance(failed[7], DecodeError)
    assert str(failed[7]) == "value of 5000 bytes exceeds worker.max_message_bytes=4000"


@pytest.mark.parametrize(
    ("count", "workers", "expected"),
    [
        (12, 2, [(0, 6), (6, 12)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (3, 8, [(0, 1), (1, 2), (2, 3)]),  # never more slices than rows
        (0, 4, [(0, 0)]),  # at least one slice
    ],
)
def test_row_slices_are_contiguous_and_differ_by_at_most_one_row(
    count: int, workers: int, expected: list[tuple[int, int]]
) -> None:
    assert row_slices(count, workers) == expected


class _RegistryDown(_Recorder):
    """A workload whose registry lookups were abandoned (the process closing)."""

    def decode(self, record: Record, out: np.ndarray) -> None:
        raise RegistryUnavailable("schema registry unavailable while closing")

    def decode_many(self, records: list[Record], rows: np.ndarray) -> dict:  # type: ignore[type-arg]
        raise RegistryUnavailable("schema registry unavailable while closing")


def test_an_unavailable_registry_is_raised_never_turned_into_dead_letters() -> None:
    # A registry outage is not the records' fault: neither the per-run call nor the per-record
    # fallback may turn it into DecodeErrors (which would dead-letter valid records).
    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 13)]
    rows = np.full((3, 1), -1.0)
    with pytest.raises(RegistryUnavailable):
        decode_rows(_RegistryDown(), records, rows, 0, {})  # type: ignore[arg-type]
    from streamproc.workloads.base import Workload

    with pytest.raises(RegistryUnavailable):
        Workload.decode_many(_RegistryDown(), records, rows)  # type: ignore[arg-type]
