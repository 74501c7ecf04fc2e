"""Thread and process decoders fill staging slabs identically and lose no record.

The process decoder runs real spawned processes writing into real shared-memory slabs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from streamproc.decoders import DecodeProcesses, LaneSpec, ProcessDecoder, ThreadDecoder
from streamproc.errors import DecodeError
from streamproc.records import Record, TopicPartition
from streamproc.worker import StagingPool
from streamproc.workloads import load_workload
from streamproc.workloads.trades import trade_messages

TP = TopicPartition("trades", 0)
ROWS = 16
CRASHING = "tests.support.crashing:make_workload"


def _batch() -> list[Record]:
    values = [v for _, v in itertools.islice(trade_messages(), 12)]
    values[3] = b"{not json"
    values[7] = b"x" * 5000  # over the 4,000-byte limit below
    values[9] = None  # tombstone
    return [Record(TP, o, b"k", v, (), 0, 0.0, 1) for o, v in enumerate(values)]


@pytest.fixture
def shared_pool() -> Iterator[StagingPool]:
    workload = load_workload("trades")
    pool = StagingPool(3, ROWS, workload.item_shape, workload.item_dtype, pin=False, shared=True)
    yield pool
    pool.close()


def _processes(pool: StagingPool, workload: str, workers: int = 2) -> DecodeProcesses:
    processes = DecodeProcesses(workers)
    processes.register(
        "trades", LaneSpec(workload, {}, pool.shared_names, pool.shape, pool.dtype.str)
    )
    processes.start()
    return processes


def test_process_decoder_matches_thread_decoder(shared_pool: StagingPool) -> None:
    records = _batch()
    workload = load_workload("trades")
    private = StagingPool(1, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    with ThreadPoolExecutor(2) as executor:
        expected = ThreadDecoder(workload, executor, 2, 4000).decode(records, private.lease())
    processes = _processes(shared_pool, "trades")
    try:
        slab = shared_pool.lease()
        assert slab is not None
        slab.array[:] = np.nan
        failed = ProcessDecoder(processes, "trades", 4000).decode(records, slab)
    finally:
        processes.close()
    assert sorted(failed) == sorted(expected) == [3, 7, 9]
    assert all(isinstance(e, DecodeError) for e in failed.values())
    assert "exceeds worker.max_message_bytes=4000" in str(failed[7])
    good = [r for r in range(len(records)) if r not in failed]
    # The rows written by the other processes are visible here through the shared slab.
    np.testing.assert_array_equal(slab.array[good], private._slabs[0].array[good])
    assert not np.isnan(slab.array[good]).any()
    assert shared_pool.allocations == 3  # nothing allocated per batch


def test_a_dying_decode_process_dead_letters_its_slice_and_is_replaced(
    shared_pool: StagingPool,
) -> None:
    records = _batch()
    records[1] = Record(TP, 1, b"k", b"crash", (), 0, 0.0, 1)
    processes = _processes(shared_pool, CRASHING)
    decoder = ProcessDecoder(processes, "trades", 4000)
    try:
        slab = shared_pool.lease()
        assert slab is not None
        failed = decoder.decode(records, slab)
        assert 1 in failed and "decode process died" in str(failed[1])
        # every row is accounted for: decoded, or failed with a reason (nothing silently lost)
        assert set(failed) >= {1, 3, 7, 9}
        # the pool was replaced: the next batch (no crash marker) decodes normally
        again = decoder.decode(_batch(), slab)
        assert sorted(again) == [3, 7, 9]
    finally:
        processes.close()


def test_shared_slabs_are_unlinked_on_close() -> None:
    workload = load_workload("trades")
    pool = StagingPool(2, ROWS, workload.item_shape, workload.item_dtype, pin=False, shared=True)
    names = pool.shared_names
    assert len(names) == 2
    pool.close()
    from multiprocessing import shared_memory

    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
