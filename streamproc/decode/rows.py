"""Row helpers shared by every decoder: refuse oversized values, split a batch into slices for
the decode workers, and decode one slice into its rows.

Pure functions of their arguments (no threads, no processes): :func:`decode_rows` runs on a
decode thread, in a decode process, or inline on a dispatcher thread alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import numpy as np

from streamproc.decode.protocol import Failures
from streamproc.errors import DecodeError, RecordError, RegistryUnavailable
from streamproc.records import Record
from streamproc.workloads import Workload


def oversized(records: Sequence[Record], max_message_bytes: int) -> Failures:
    """Rows whose value exceeds ``max_message_bytes`` (they are dead-lettered, not decoded)."""
    return {
        row: DecodeError(
            f"value of {len(record.value)} bytes exceeds "
            f"worker.max_message_bytes={max_message_bytes}"
        )
        for row, record in enumerate(records)
        if record.value is not None and len(record.value) > max_message_bytes
    }


def row_slices(count: int, workers: int) -> list[tuple[int, int]]:
    """``min(count, workers)`` (at least one) contiguous ``(start, stop)`` slices of
    ``range(count)`` whose lengths differ by at most one (so ``workers`` workers finish a batch
    in ``ceil(count / workers)`` rows' time)."""
    parts = max(1, min(count, workers))
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return list(itertools.pairwise(bounds))


def decode_rows(
    workload: Workload,
    records: Sequence[Record],
    rows: np.ndarray,
    start: int,
    skip: Collection[int],
) -> Failures:
    """Decode ``records[i]`` into ``rows[start + i]`` (skipping rows in ``skip``), one
    :meth:`~streamproc.workloads.Workload.decode_many` call per run of rows between skipped
    ones.

    Returns:
        Per failed row (counted from ``start``), the :class:`RecordError`. If a workload's
        ``decode_many`` itself raises, or answers with anything but a dict of row index (within
        the run) -> :class:`RecordError`, its run is decoded again record by record (the base
        implementation), so one workload bug costs speed, never the stream.

    Raises:
        RegistryUnavailable: the Schema Registry did not answer before the process closed.
    """
    failed: Failures = {}
    run_start = 0
    stop = start + len(records)
    for index in [*(row - start for row in sorted(skip) if start <= row < stop), len(records)]:
        if index > run_start:
            run = records[run_start:index]
            view = rows[start + run_start : start + index]
            try:
                found = _checked(workload.decode_many(run, view), len(run))
            except RegistryUnavailable:
                raise  # the registry's state, not the records': none is dead-lettered for it
            except Exception:
                found = Workload.decode_many(workload, run, view)
            for offset, error in found.items():
                failed[start + run_start + offset] = error
        run_start = index + 1
    return failed


def _checked(found: object, count: int) -> Failures:
    """``decode_many``'s answer, or TypeError if it is not a dict of row -> RecordError over
    rows ``0..count-1`` (a wrong answer would fail or score the wrong rows)."""
    if not isinstance(found, dict) or not all(
        isinstance(row, int | np.integer)
        and not isinstance(row, bool)
        and 0 <= row < count
        and isinstance(error, RecordError)
        for row, error in found.items()
    ):
        raise TypeError(f"decode_many must return dict[int, RecordError], got {found!r:.200}")
    return {int(row): error for row, error in found.items()}
