"""The decode threads and the thread decoder: slices on the threads or inline, resize, shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from streamproc.decode.protocol import DecodeSample
from streamproc.decode.route import DecodeRoutePolicy
from streamproc.decode.threads import DecodeThreads, ThreadDecoder
from streamproc.device import StagingPool
from streamproc.errors import DecodeError
from streamproc.workloads import load_workload
from tests.support.kafka_fakes import FakeClock
from tests.unit.decode.batches import ROWS, batch


def test_an_inline_lane_dead_letters_bad_rows_and_oversized_values_like_the_pool() -> None:
    records = batch()
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
    are asserted, not which way wins: tests/unit/decode/test_route.py has the rule.)"""
    records = batch()
    workload = load_workload("trades")
    pool = StagingPool(1, ROWS, workload.item_shape, workload.item_dtype, pin=False)
    threads = DecodeThreads(1)
    clock = FakeClock()
    policy = DecodeRoutePolicy(clock, probe_batches=2, margin=0.0)
    samples: list[DecodeSample] = []
    routes: list[str] = []
    decoder = ThreadDecoder(
        workload, threads, 4000, on_sample=samples.append, route=policy, on_route=routes.append
    )
    slab = pool.lease()
    assert slab is not None
    assert decoder.probing  # the policy probes from the first batch
    try:
        results = [decoder.decode(records, slab) for _ in range(4)]
        assert not decoder.probing
        clock.advance(policy.base_recheck_s)  # the next probe is due
        decoder.hold_probes = True  # the lane measures its own route: no probe starts
        results.append(decoder.decode(records, slab))
        assert not decoder.probing
        decoder.hold_probes = False
        results.append(decoder.decode(records, slab))
        assert decoder.probing
    finally:
        threads.shutdown(wait=True)
    assert len(samples) >= 2  # the two pool batches of the first probe (and later ones)
    assert routes[0] == "pool" and routes[-1] == decoder.route == policy.settled
    assert all(sorted(failed) == [3, 7, 9] for failed in results)


def _decode_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("decode_"))


def test_decode_threads_grow_and_shrink_without_dropping_a_task() -> None:
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
        assert sorted(decoder.decode(batch(), slab)) == [3, 7, 9]
        assert len(_decode_threads()) == len(before) + 2
        assert threads.resize(4) == 4
        assert len(_decode_threads()) == len(before) + 4
        assert sorted(decoder.decode(batch(), slab)) == [3, 7, 9]
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


def test_decode_threads_are_joined_at_shutdown() -> None:
    # A daemon decode thread still running when the interpreter finalises is ended with
    # pthread_exit, which aborted the process after a SIGTERM drain (exit -6); shutdown(wait)
    # must leave none alive.
    # only this pool's threads: an earlier pool's, shut down without waiting, may still be
    # ending on a loaded machine (same names; it failed once in the 4 whole runs of
    # 2026-12-02, session 6)
    earlier = set(threading.enumerate())
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
    ours = [t for t in threading.enumerate() if t not in earlier and t.name.startswith("decode_")]
    assert not ours
