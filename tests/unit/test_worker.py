from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from streamproc.records import Batch, Record, TopicPartition
from streamproc.worker import DeviceJob, DeviceResult, DeviceWorker, StagingPool

TP = TopicPartition("t", 0)


def batch(batch_id: int, n: int) -> Batch:
    records = tuple(Record(TP, batch_id * 10 + i, None, b"v", (), 0, 0.0, 1) for i in range(n))
    return Batch(batch_id, records, 0.0)


def test_pool_is_fixed_and_refuses_double_release() -> None:
    pool = StagingPool(2, rows=4, item_shape=(3,), dtype=np.dtype(np.float32), pin=False)
    a = pool.lease()
    b = pool.lease()
    assert a is not None and b is not None and a.index != b.index
    assert pool.lease(timeout_s=0.01) is None  # bounded: no growth
    pool.release(a)
    with pytest.raises(ValueError):
        pool.release(a)
    assert pool.allocations == 2 and pool.in_use == 1
    assert a.array.shape == (4, 3) and np.shares_memory(a.array, a.tensor.numpy())


def run_worker(model, jobs: list[tuple[int, int]]) -> tuple[list[DeviceResult], StagingPool]:  # type: ignore[no-untyped-def]
    pool = StagingPool(3, rows=4, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    results: queue.Queue[DeviceResult] = queue.Queue()
    copies: list[DeviceResult] = []
    errors: list[BaseException] = []

    def on_result(result: DeviceResult) -> None:
        # outputs are only valid during the call: copy what the test checks
        copies.append(
            DeviceResult(
                result.batch,
                tuple(o.copy() for o in result.outputs),
                result.failed,
                result.error,
                result.inference_s,
            )
        )
        results.put(result)

    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 2, on_result, errors.append)
    worker.start()
    for batch_id, n in jobs:
        slab = pool.lease()
        assert slab is not None
        slab.array[:n] = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + batch_id * 100
        worker.submit(DeviceJob(batch(batch_id, n), slab))
    for _ in jobs:
        results.get(timeout=30)
    worker.close()
    assert not errors
    return copies, pool


def test_results_arrive_in_order_with_one_row_per_record() -> None:
    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.sum(dim=1), x[:, :1] * 2)

    results, pool = run_worker(model, [(1, 3), (2, 1), (3, 4), (4, 2)])
    assert [r.batch.batch_id for r in results] == [1, 2, 3, 4]
    for result in results:
        n = len(result.batch)
        base = result.batch.batch_id * 100
        expected = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + base
        np.testing.assert_allclose(result.outputs[0], expected.sum(axis=1))
        assert result.outputs[1].shape == (n, 1)
        assert result.error is None
    assert pool.in_use == 0  # every slab went back


def test_model_errors_and_wrong_row_counts_fail_the_batch_not_the_worker() -> None:
    calls = threading.local()

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.shape[0] == 1:
            raise RuntimeError("boom")
        if x.shape[0] == 2:
            return (x[:1],)  # wrong number of rows
        calls.ok = True
        return (x,)

    results, pool = run_worker(model, [(1, 1), (2, 2), (3, 3)])
    assert "boom" in str(results[0].error)
    assert "rows" in str(results[1].error)
    assert results[2].error is None and results[2].outputs[0].shape == (3, 2)
    assert pool.in_use == 0


class FakeCopyEvent:
    """A host-to-device copy that finishes when the test says so."""

    def __init__(self) -> None:
        self.fired = threading.Event()

    def query(self) -> bool:
        return self.fired.is_set()


def test_staging_buffer_is_reused_only_after_its_copy_event_fired() -> None:
    pool = StagingPool(1, rows=2, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    events: list[FakeCopyEvent] = []

    def factory() -> FakeCopyEvent:
        events.append(FakeCopyEvent())
        return events[-1]

    results: queue.Queue[DeviceResult] = queue.Queue()
    worker = DeviceWorker(
        lambda x: (x * 2,),
        torch.device("cpu"),
        pool,
        1,
        1,
        results.put,
        print,
        event_factory=factory,
    )
    worker.start()
    slab = pool.lease()
    assert slab is not None
    worker.submit(DeviceJob(batch(1, 2), slab))
    # the batch is computed, but its copy has not "finished": the only slab must stay leased
    assert pool.lease(timeout_s=0.3) is None
    assert results.empty()
    events[0].fired.set()
    assert results.get(timeout=10).batch.batch_id == 1
    again = pool.lease(timeout_s=10)
    assert again is slab  # reused only now
    pool.release(again)
    worker.close()


def test_calibration_measures_every_size_the_adaptive_batcher_needs_before_traffic() -> None:
    from streamproc.batcher import Batcher
    from streamproc.buffers import PartitionBuffers
    from streamproc.commit import OffsetTracker
    from streamproc.lane import Lane

    pool = StagingPool(3, rows=16, item_shape=(8,), dtype=np.dtype(np.float32), pin=False)
    seen: list[int] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append(x.shape[0])
        return (x.sum(dim=1),)

    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 1, lambda r: None, print)
    batcher = Batcher(16, 1 << 30, 0.02, adaptive=True)
    lane = Lane("t", PartitionBuffers(64, 0.75, 0.25), batcher, OffsetTracker())
    assert batcher.unmeasured() == 1
    runs = lane.calibrate(worker.time_batch)
    assert batcher.unmeasured() is None  # nothing left to explore on live traffic
    assert runs == len(seen) and runs >= 3
    sizer = batcher.sizer
    assert sizer is not None
    measured = [s for s in sizer.candidates if sizer.throughput(s) is not None]
    assert measured and all(seen.count(s) >= 3 for s in measured)
    assert batcher.target in measured
    assert pool.in_use == 0  # the slab went back
    assert Batcher(16, 1 << 30, 0.02).unmeasured() is None  # fixed size: nothing to calibrate
