"""Thread and process decoders fill staging slabs identically and lose no record.

The process decoder runs real spawned processes writing into real shared-memory slabs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from streamproc.decode.decoders import (
    DecodeProcesses,
    DecodeThreads,
    LaneSpec,
    ProcessDecoder,
    ThreadDecoder,
)
from streamproc.decode.sizing import DecodeRoutePolicy, DecodeSample
from streamproc.device import StagingPool
from streamproc.errors import DecodeError
from streamproc.records import Record, TopicPartition
from streamproc.testing import FakeClock
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


def test_an_inline_lane_dead_letters_bad_rows_and_oversized_values_like_the_pool() -> None:
    records = _batch()
    workload = load_workload("trades")
    pool = StagingPool(2, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    threads = DecodeThreads(2)
    samples: list[DecodeSample] = []
    routes: list[str] = []
    try:
        on_pool, inline = pool.lease(), pool.lease()
        assert on_pool is not None and inline is not None
        on_pool.array[:] = np.nan
        inline.array[:] = np.nan
        expected = ThreadDecoder(workload, threads, 4000).decode(records, on_pool)
        decoder = ThreadDecoder(
            workload,
            threads,
            4000,
            on_sample=samples.append,
            route="inline",
            on_route=routes.append,
        )
        failed = decoder.decode(records, inline)
    finally:
        threads.shutdown(wait=True)
    assert routes == ["inline"]
    assert samples == []  # inline batches never reach the sizer: they do not use the pool
    assert sorted(failed) == sorted(expected) == [3, 7, 9]
    for row in failed:
        assert type(failed[row]) is type(expected[row]) is DecodeError
        assert str(failed[row]) == str(expected[row])
        assert failed[row].stage == expected[row].stage == "decode"
    assert "exceeds worker.max_message_bytes=4000" in str(failed[7])
    good = [r for r in range(len(records)) if r not in failed]
    np.testing.assert_array_equal(inline.array[good], on_pool.array[good])
    assert not np.isnan(inline.array[good]).any()


def test_a_route_policy_sends_probe_batches_both_ways_and_settles_where_cheaper() -> None:
    """The decoder follows its policy batch by batch and reports the change; the slabs come out
    the same either way. (The costs are the real ones of this machine, so only the mechanics
    are asserted, not which way wins: tests/unit/decode/test_sizing.py has the rule.)"""
    records = _batch()
    workload = load_workload("trades")
    pool = StagingPool(1, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    threads = DecodeThreads(1)
    policy = DecodeRoutePolicy(FakeClock(), probe_batches=2, margin=0.0)
    samples: list[DecodeSample] = []
    routes: list[str] = []
    decoder = ThreadDecoder(
        workload, threads, 4000, on_sample=samples.append, route=policy, on_route=routes.append
    )
    slab = pool.lease()
    assert slab is not None
    try:
        results = [decoder.decode(records, slab) for _ in range(4)]
    finally:
        threads.shutdown(wait=True)
    assert not policy.probing
    assert len(samples) == 2  # the two pool batches of the probe
    assert routes[0] == "pool" and routes[-1] == decoder.route == policy.settled
    assert all(sorted(failed) == [3, 7, 9] for failed in results)


def test_a_slice_that_kills_its_process_twice_is_dead_lettered_others_are_retried(
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
        # slices of 6 rows (2 processes): rows 0-5 hold the crash and kill their process
        # twice -> all failed with the reason; rows 6-11 ran in the other process, decoded.
        assert sorted(failed) == [0, 1, 2, 3, 4, 5, 7, 9]
        assert "decode process died" in str(failed[1])
        assert "decode process died" in str(failed[0])  # innocent, same slice: cannot tell
        assert isinstance(failed[7], DecodeError) and "exceeds" in str(failed[7])
        assert processes.generation == 2  # one restart per crash, of that process only
        # the pool works again: the next batch (no crash marker) decodes normally
        again = decoder.decode(_batch(), slab)
        assert sorted(again) == [3, 7, 9]
    finally:
        processes.close()


_ORPHAN_SCRIPT = """
import sys
from streamproc.decode.decoders import DecodeProcesses, LaneSpec, ProcessDecoder
from streamproc.records import Record, TopicPartition
from streamproc.testing import FakeClock
from streamproc.device import StagingPool
from streamproc.workloads import load_workload

if __name__ == "__main__":
    w = load_workload("trades")
    pool = StagingPool(2, 4, w.item_shape, w.item_dtype, pin=False, shared=True)
    processes = DecodeProcesses(2)
    processes.register("t", LaneSpec("trades", {}, pool.shared_names, pool.shape, pool.dtype.str))
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
    from streamproc.decode.decoders import decode_rows

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
    from streamproc.decode.decoders import decode_rows

    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 16)]
    rows = np.full((6, 1), -1.0)
    # the stub writes nothing before answering: a row left unwritten would be scored on stale
    # data unless the run is decoded again
    assert decode_rows(_Recorder(answer=answer), records, rows, 0, {}) == {}  # type: ignore[arg-type]
    assert rows[:, 0].tolist() == [10, 11, 12, 13, 14, 15]


def test_numpy_integer_rows_from_decode_many_are_accepted() -> None:
    from streamproc.decode.decoders import decode_rows

    records = [Record(TP, o, None, b"v", (), 0, 0.0, 1) for o in range(10, 13)]
    rows = np.full((3, 1), -1.0)
    failed = decode_rows(_Recorder(answer={np.int64(1): DecodeError("x")}), records, rows, 0, {})  # type: ignore[arg-type]
    assert failed.keys() == {1} and type(next(iter(failed))) is int
    assert rows[:, 0].tolist() == [-1, -1, -1]  # the stub's answer was taken: no fallback


def _decode_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("decode_"))


def test_decode_threads_grow_and_shrink_without_dropping_a_task() -> None:
    import threading
    import time

    before = _decode_threads()
    threads = DecodeThreads(2)
    assert _decode_threads() == before  # started on the first task, not at construction
    samples: list[DecodeSample] = []
    workload = load_workload("trades")
    pool = StagingPool(2, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    decoder = ThreadDecoder(workload, threads, 4000, lane="trades", on_sample=samples.append)
    try:
        slab = pool.lease()
        assert slab is not None
        assert sorted(decoder.decode(_batch(), slab)) == [3, 7, 9]
        assert len(_decode_threads()) == len(before) + 2
        assert threads.resize(4) == 4
        assert len(_decode_threads()) == len(before) + 4
        assert sorted(decoder.decode(_batch(), slab)) == [3, 7, 9]
        # shrink while tasks are queued: every queued task still runs, then two threads exit
        gate = threading.Event()
        blocked = [threads.submit(gate.wait, 30) for _ in range(4)]
        queued = [threads.submit(lambda i=i: i) for i in range(6)]
        threads.resize(2)
        gate.set()
        assert [f.result(timeout=30) for f in blocked] == [True] * 4
        assert [f.result(timeout=30) for f in queued] == list(range(6))
        ours = [t for t in threading.enumerate() if t.name.startswith("decode_")]
        ours = [t for t in ours if t.name not in before]
        deadline = time.monotonic() + 30
        while sum(t.is_alive() for t in ours) > 2 and time.monotonic() < deadline:
            for thread in ours:
                thread.join(0.05)  # two of them take a retire marker and exit
        assert sum(t.is_alive() for t in ours) == 2 and threads.workers == 2
        assert [(s.lane, s.items, s.workers) for s in samples] == [
            ("trades", 12, 2),
            ("trades", 12, 4),
        ]
        assert all(s.decode_s > 0 for s in samples)
    finally:
        threads.shutdown()
        pool.close()
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit(print)


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
        assert sorted(decoder.decode(_batch(), slab)) == [3, 7, 9]  # three slices of 4
        assert processes.resize(1) == 1 and processes.pids() == first
        assert sorted(decoder.decode(_batch(), slab)) == [3, 7, 9]
        assert processes.generation == 0  # nothing died
    finally:
        processes.close()


def test_decode_threads_are_joined_at_shutdown() -> None:
    # A daemon decode thread still running when the interpreter finalises is ended with
    # pthread_exit, which aborted the process after a SIGTERM drain (exit -6); shutdown(wait)
    # must leave none alive.
    threads = DecodeThreads(3)
    started = threading.Event()
    release = threading.Event()

    def task() -> int:
        started.set()
        release.wait(30)
        return 1

    future = threads.submit(task)
    assert started.wait(30)  # a thread start on a loaded machine
    release.set()
    threads.shutdown(wait=True, cancel_futures=True)
    assert future.result(0) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("decode_")]
