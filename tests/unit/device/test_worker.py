from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import structlog
import torch

from streamproc.device import (
    CpuBackend,
    DeviceJob,
    DeviceResult,
    DeviceWorker,
    PoolLeak,
    Release,
    StagingPool,
)
from streamproc.device.backend import Event, Mark
from streamproc.output.resequencer import Resequencer
from streamproc.records import Batch, Record, TopicPartition

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

    def on_complete(result: DeviceResult, release: Release) -> None:
        # outputs are only valid until release(): copy what the test checks
        copies.append(
            DeviceResult(
                result.batch,
                tuple(o.copy() for o in result.outputs),
                result.failed,
                result.error,
                result.inference_s,
            )
        )
        release()
        results.put(result)

    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 2, on_complete, errors.append)
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


def test_on_cpu_the_device_thread_completes_its_batches_without_a_completion_thread() -> None:
    """The events of a CPU launch have fired when it returns: the device thread returns the
    slab and calls ``on_complete`` itself, in order, and no completion thread is started."""
    pool = StagingPool(3, rows=4, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def on_complete(result: DeviceResult, release: Release) -> None:
        seen.append((result.batch.batch_id, threading.current_thread().name))
        release()
        if len(seen) == 5:
            done.set()

    worker = DeviceWorker(
        lambda x: (x.sum(dim=1),),
        torch.device("cpu"),
        pool,
        2,
        2,
        on_complete,
        print,
        label="cpu:7",
    )
    worker.start()
    names = {thread.name for thread in threading.enumerate()}
    assert "device-cpu:7" in names and "completion-cpu:7" not in names
    for batch_id in range(1, 6):
        slab = pool.lease()
        assert slab is not None
        worker.submit(DeviceJob(batch(batch_id, 2), slab))
    assert done.wait(30)
    worker.close()
    assert [batch_id for batch_id, _ in seen] == [1, 2, 3, 4, 5]
    assert {name for _, name in seen} == {"device-cpu:7"}
    assert pool.in_use == 0 and worker.output_leak().missing == 0


def test_model_errors_and_wrong_row_counts_fail_the_batch_not_the_worker() -> None:
    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = float(x[0, 0])  # batch k's rows start at k * 100 (run_worker)
        if 100 <= first < 200:
            raise RuntimeError("boom")
        if 200 <= first < 300:
            return (x[:-1],)  # one row too few, whatever the rows
        return (x,)

    results, pool = run_worker(model, [(1, 1), (2, 2), (3, 3)])
    assert "boom" in str(results[0].error)
    assert "rows" in str(results[1].error)  # every row failed alone: no outputs at all
    assert sorted(results[1].failed) == [0, 1]
    assert results[2].error is None and results[2].outputs[0].shape == (3, 2)
    assert pool.in_use == 0


class FakeCopyEvent:
    """A host-to-device copy that finishes when the test says so."""

    def __init__(self) -> None:
        self.fired = threading.Event()

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        self.fired.wait()


class LateCopies(CpuBackend):
    """The CPU backend whose ``copied`` events fire when the test says so (a copy engine that
    finishes after the launch returned); every other event is the CPU's."""

    def __init__(self, copy_event: Callable[[], FakeCopyEvent]) -> None:
        super().__init__()
        self._copy_event = copy_event

    def record(self, mark: Mark) -> Event:
        return self._copy_event() if mark == "copied" else super().record(mark)


def release_then(
    handle: Callable[[DeviceResult], None],
) -> Callable[[DeviceResult, Release], None]:
    """An ``on_complete`` that gives the outputs back at once, then calls ``handle``."""

    def on_complete(result: DeviceResult, release: Release) -> None:
        release()
        handle(result)

    return on_complete


def test_staging_buffer_is_reused_only_after_its_copy_event_fired() -> None:
    pool = StagingPool(1, rows=2, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    events: list[FakeCopyEvent] = []

    def factory() -> FakeCopyEvent:
        events.append(FakeCopyEvent())
        return events[-1]

    results: queue.Queue[tuple[DeviceResult, str]] = queue.Queue()
    worker = DeviceWorker(
        lambda x: (x * 2,),
        torch.device("cpu"),
        pool,
        1,
        1,
        release_then(lambda r: results.put((r, threading.current_thread().name))),
        print,
        backend=LateCopies(factory),
    )
    worker.start()
    slab = pool.lease()
    assert slab is not None
    worker.submit(DeviceJob(batch(1, 2), slab))
    # the batch is computed, but its copy has not "finished": the only slab must stay leased
    assert pool.lease(timeout_s=0.3) is None
    assert results.empty()
    events[0].fired.set()
    result, thread = results.get(timeout=10)
    assert result.batch.batch_id == 1
    assert thread == "device-cpu"  # the production CPU path: no completion thread
    again = pool.lease(timeout_s=10)
    assert again is slab  # reused only now
    pool.release(again)
    worker.close()


def test_calibration_measures_every_size_the_adaptive_batcher_needs_before_traffic() -> None:
    from streamproc.intake.batcher import Batcher
    from streamproc.intake.lane import Lane
    from streamproc.intake.rings import PartitionBuffers
    from streamproc.offsets.tracker import OffsetTracker

    pool = StagingPool(3, rows=16, item_shape=(8,), dtype=np.dtype(np.float32), pin=False)
    seen: list[int] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append(x.shape[0])
        return (x.sum(dim=1),)

    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 1, lambda r, release: None, print)
    worker.start()  # the timings run on the device thread, after its warm-up
    seen.clear()
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
    worker.close()
    assert Batcher(16, 1 << 30, 0.02).unmeasured() is None  # fixed size: nothing to calibrate


# -- the pool leak check (close) ----------------------------------------------------------------


def test_leak_check_names_the_pool_count_and_batch_of_a_batch_that_never_completed() -> None:
    from streamproc.device.staging import LEAK_EVENT, report_leaks
    from streamproc.metrics import Metrics

    pool = StagingPool(3, rows=2, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    never = FakeCopyEvent()  # this batch's copy never finishes: it never completes
    completed: queue.Queue[tuple[DeviceResult, Release]] = queue.Queue()
    worker = DeviceWorker(
        lambda x: (x * 2,),
        torch.device("cpu"),
        pool,
        2,
        1,
        lambda result, release: completed.put((result, release)),
        print,
        backend=LateCopies(lambda: never),
        label="cpu:1",
    )
    worker.start()
    slab = pool.lease(batch_id=7)
    assert slab is not None
    worker.submit(DeviceJob(batch(7, 2), slab))
    worker.close(timeout_s=0.5)  # the drain gives up on it
    metrics = Metrics()
    with structlog.testing.capture_logs() as logs:
        leaks = report_leaks("frames", [pool.leak(), worker.output_leak()], metrics)
    assert leaks == (
        PoolLeak("staging", 3, 1, (7,)),
        PoolLeak("output cpu:1", 2, 1, (7,)),
    )
    errors = [e for e in logs if e["event"] == LEAK_EVENT]
    assert [(e["topic"], e["pool"], e["missing"], e["batch_ids"]) for e in errors] == [
        ("frames", "staging", 1, [7]),
        ("frames", "output cpu:1", 1, [7]),
    ]
    for name in ("staging", "output cpu:1"):
        labels = {"topic": "frames", "pool": name}
        assert metrics.registry.get_sample_value("streamproc_pool_leaked_buffers", labels) == 1
    never.fired.set()  # let the device thread finish
    _, release = completed.get(timeout=10)
    release()


def test_leak_check_of_a_clean_run_reports_zero() -> None:
    from streamproc.device.staging import report_leaks
    from streamproc.metrics import Metrics

    copies, pool, worker = run_worker_keeping(lambda x: (x.sum(dim=1),), [(1, 3), (2, 4), (3, 1)])
    assert [c.batch.batch_id for c in copies] == [1, 2, 3]
    metrics = Metrics()
    with structlog.testing.capture_logs() as logs:
        assert report_leaks("t", [pool.leak(), worker.output_leak()], metrics) == ()
    assert not [e for e in logs if e["log_level"] == "error"]
    sample = metrics.registry.get_sample_value
    assert sample("streamproc_pool_leaked_buffers", {"topic": "t", "pool": "staging"}) == 0
    assert sample("streamproc_pool_leaked_buffers", {"topic": "t", "pool": "output cpu"}) == 0


def run_worker_keeping(  # type: ignore[no-untyped-def]
    model, jobs: list[tuple[int, int]]
) -> tuple[list[DeviceResult], StagingPool, DeviceWorker]:
    """:func:`run_worker`, also returning the (closed) worker."""
    pool = StagingPool(3, rows=4, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    results: queue.Queue[DeviceResult] = queue.Queue()

    def on_complete(result: DeviceResult, release: Release) -> None:
        release()
        results.put(result)

    worker = DeviceWorker(model, torch.device("cpu"), pool, 2, 1, on_complete, print)
    worker.start()
    for batch_id, n in jobs:
        slab = pool.lease(batch_id=batch_id)
        assert slab is not None
        worker.submit(DeviceJob(batch(batch_id, n), slab))
    done = [results.get(timeout=30) for _ in jobs]
    worker.close()
    return done, pool, worker


def test_live_model_calls_run_in_inference_mode_and_keep_no_autograd_graph() -> None:
    # Issue 29: warm-up ran under torch.inference_mode(), live batches did not: a model that
    # does not say so itself built an autograd graph per batch (its weights require grad)
    # and the outputs copied into the output buffers kept each batch's activations alive.
    linear = torch.nn.Linear(2, 1)  # requires_grad weights, as a user's model has
    seen: list[tuple[bool, bool]] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = linear(x)[:, 0]
        seen.append((torch.is_inference_mode_enabled(), out.requires_grad))
        return (out,)

    results, pool, worker = run_worker_keeping(model, [(1, 3), (2, 4)])
    live = seen[-2:]  # warm-up's calls come first
    assert live == [(True, False), (True, False)]
    assert [r.outputs[0].shape for r in results] == [(3,), (4,)]
    assert pool.in_use == 0 and worker.output_leak().missing == 0


def test_start_fails_at_once_when_the_device_thread_dies_before_answering() -> None:
    # Issue 29 review: start-up work waits on the device thread's answer; a device thread that
    # died first (here: binding the device raised) left start() waiting for ever
    class Unbindable(CpuBackend):
        def bind_thread(self) -> None:
            raise RuntimeError("no such device")

    fatal: list[BaseException] = []
    pool = StagingPool(2, rows=2, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    worker = DeviceWorker(
        lambda x: (x * 2,), torch.device("cpu"), pool, 1, 1, lambda r, release: release(),
        fatal.append, backend=Unbindable(),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="device thread ended before answering"):
        worker.start()  # no timeout: the liveness check ends the wait
    assert [str(e) for e in fatal] == ["no such device"]
    assert pool.in_use == 0


# -- the resequencer ------------------------------------------------------------------------------


def result_of(batch_id: int) -> DeviceResult:
    return DeviceResult(batch(batch_id, 1), (), {}, None, 0.0)


def test_resequencer_hands_results_over_in_batch_order_whatever_the_completion_order() -> None:
    handed: queue.Queue[int] = queue.Queue()
    released: list[int] = []
    fatal: list[BaseException] = []
    reseq = Resequencer("t", lambda r: handed.put(r.batch.batch_id), released.append, fatal.append)
    reseq.start()
    returned: list[int] = []
    for batch_id in (3, 2, 5):
        reseq.put(result_of(batch_id), partial(returned.append, batch_id))
    assert reseq.held == 3 and handed.empty()  # all wait for batch 1
    reseq.put(result_of(1), lambda: returned.append(1))
    assert [handed.get(timeout=10) for _ in range(3)] == [1, 2, 3]
    reseq.put(result_of(4), lambda: returned.append(4))
    assert [handed.get(timeout=10) for _ in range(2)] == [4, 5]
    reseq.close(10)
    assert returned == released == [1, 2, 3, 4, 5]  # output buffers, then in-flight slots
    assert reseq.max_waiting == 3 and not fatal  # 2, 3 and 5 waited for 1
    with pytest.raises(ValueError, match="twice"):
        reseq.put(result_of(2), lambda: None)


def test_resequencer_close_drops_what_waits_behind_a_batch_that_never_came() -> None:
    handed: list[int] = []
    released: list[int] = []
    returned: list[int] = []
    reseq = Resequencer("t", lambda r: handed.append(r.batch.batch_id), released.append, print)
    reseq.start()
    reseq.put(result_of(2), lambda: returned.append(2))
    reseq.put(result_of(3), lambda: returned.append(3))
    with structlog.testing.capture_logs() as logs:
        reseq.close(10)
    assert handed == []  # never out of order
    assert returned == released == [2, 3]  # but their buffers and slots are back
    warning = next(e for e in logs if e["event"].startswith("results dropped"))
    assert warning["waiting_for_batch"] == 1 and warning["dropped_batches"] == [2, 3]
