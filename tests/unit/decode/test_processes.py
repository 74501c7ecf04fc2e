"""Process decoders fill staging slabs like the thread decoder and lose no record.

These run real spawned processes writing into real shared-memory slabs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from streamproc.decode.process_child import DecodeSpec
from streamproc.decode.processes import DecodeProcesses, ProcessDecoder
from streamproc.decode.threads import DecodeThreads, ThreadDecoder
from streamproc.device import StagingPool
from streamproc.errors import DecodeError
from streamproc.records import Record
from streamproc.workloads import load_workload
from tests.unit.decode.batches import ROWS, TP, batch

CRASHING = "tests.support.crashing:make_workload"


@pytest.fixture
def shared_pool() -> Iterator[StagingPool]:
    workload = load_workload("trades")
    pool = StagingPool(3, ROWS, workload.item_shape, workload.item_dtype, pin=False, shared=True)
    yield pool
    pool.close()


def _processes(pool: StagingPool, workload: str, workers: int = 2) -> DecodeProcesses:
    processes = DecodeProcesses(workers)
    processes.register(
        "trades", DecodeSpec(workload, {}, pool.shared_names, pool.shape, pool.dtype.str)
    )
    processes.start()
    return processes


def test_process_decoder_matches_thread_decoder(shared_pool: StagingPool) -> None:
    records = batch()
    workload = load_workload("trades")
    private = StagingPool(1, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    threads = DecodeThreads(2)
    try:
        expected = ThreadDecoder(workload, threads, 4000).decode(records, private.lease())
    finally:
        threads.shutdown()
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


def test_a_slice_that_kills_its_process_twice_is_dead_lettered_others_are_retried(
    shared_pool: StagingPool,
) -> None:
    records = batch()
    records[1] = Record(TP, 1, b"k", b"crash", (), 0, 0.0, 1)
    processes = _processes(shared_pool, CRASHING)
    decoder = ProcessDecoder(processes, "trades", 4000)
    try:
        slab = shared_pool.lease()
        assert slab is not None
        failed = decoder.decode(records, slab)
        # slices of 6 rows (2 processes): rows 0-5 hold the crash and kill their process
        # twice -> all failed with the reason; rows 6-11 ran in the other process, decoded.
        assert sorted(failed) == [0, 1, 2, 3, 4, 5, 7, 9]
        assert "decode process died" in str(failed[1])
        assert "decode process died" in str(failed[0])  # innocent, same slice: cannot tell
        assert isinstance(failed[7], DecodeError) and "exceeds" in str(failed[7])
        assert processes.generation == 2  # one restart per crash, of that process only
        # the pool works again: the next batch (no crash marker) decodes normally
        again = decoder.decode(batch(), slab)
        assert sorted(again) == [3, 7, 9]
    finally:
        processes.close()


_ORPHAN_SCRIPT = """
import sys
from streamproc.decode import DecodeProcesses, DecodeSpec, ProcessDecoder
from streamproc.records import Record, TopicPartition
from tests.support.kafka_fakes import FakeClock
from streamproc.device import StagingPool
from streamproc.workloads import load_workload

if __name__ == "__main__":
    w = load_workload("trades")
    pool = StagingPool(2, 4, w.item_shape, w.item_dtype, pin=False, shared=True)
    processes = DecodeProcesses(2)
    processes.register("t", DecodeSpec("trades", {}, pool.shared_names, pool.shape, pool.dtype.str))
    processes.start()
    print(" ".join(str(p) for p in processes.pids()), flush=True)
    decoder = ProcessDecoder(processes, "t", 1 << 20)
    for _ in sys.stdin:  # one decode per line: answers the generation it ran in
        rec = Record(TopicPartition("t", 0), 0, None, b'{"symbol": "X"}', (), 0, 0.0, 1)
        failed = decoder.decode([rec, rec], pool.lease())
        print(processes.generation, len(failed), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_decode_processes_ignore_group_signals_and_exit_with_the_consumer() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    with subprocess.Popen(  # the end of the block closes both pipes and reaps the process
        [sys.executable, "-c", _ORPHAN_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as consumer:
        try:
            assert consumer.stdout is not None
            children = [int(p) for p in consumer.stdout.readline().split()]
            assert len(children) == 2 and all(_alive(p) for p in children)
            assert consumer.stdin is not None
            for pid in children:  # what Ctrl-C / a group-wide SIGTERM delivers to them
                os.kill(pid, signal.SIGINT)
                os.kill(pid, signal.SIGTERM)
            consumer.stdin.write(b"decode\n")
            consumer.stdin.flush()
            # Same pool (generation 0) still decoding: both rows fail schema validation there,
            # nothing died. A killed process would have forced a restart (generation 1).
            assert consumer.stdout.readline().split() == [b"0", b"2"]
            assert all(_alive(p) for p in children)
            consumer.kill()  # kill -9 of the consumer: nothing can clean up for it
            consumer.wait(10)
            deadline = time.monotonic() + 15
            while any(_alive(p) for p in children) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling an observable condition, bounded
            assert not any(_alive(p) for p in children), "decode processes outlived the consumer"
        finally:
            if consumer.poll() is None:
                consumer.kill()


def test_decode_processes_resize_one_process_at_a_time(shared_pool: StagingPool) -> None:
    processes = _processes(shared_pool, "trades", workers=1)
    decoder = ProcessDecoder(processes, "trades", 4000)
    try:
        first = processes.pids()
        assert len(first) == 1
        assert processes.resize(3) == 3
        grown = processes.pids()
        assert len(grown) == 3 and grown[0] == first[0]  # the running one is kept
        slab = shared_pool.lease()
        assert slab is not None
        assert sorted(decoder.decode(batch(), slab)) == [3, 7, 9]  # three slices of 4
        assert processes.resize(1) == 1 and processes.pids() == first
        assert sorted(decoder.decode(batch(), slab)) == [3, 7, 9]
        assert processes.generation == 0  # nothing died
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
