"""The device backends. The CPU backend as production runs it; the CUDA backend's own logic
(streams, events, timing, synchronisation, the asynchronous completion path of the worker) with
the part of ``torch.cuda`` it calls faked, so it runs without a GPU. Its run on a real GPU is
the ``gpu`` tier (tests/gpu)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import structlog
import torch

from streamproc.device import (
    CpuBackend,
    CudaBackend,
    DeviceJob,
    DeviceResult,
    DeviceWorker,
    Release,
    StagingPool,
)
from streamproc.device.backend import Fired, backend_for, service_s
from streamproc.records import Batch, Record, TopicPartition
from tests.support.waiting import wait_until


def batch(batch_id: int, n: int) -> Batch:
    tp = TopicPartition("t", 0)
    return Batch(batch_id, tuple(Record(tp, i, None, b"v", (), 0, 0.0, 1) for i in range(n)), 0.0)


# -- the CPU backend ------------------------------------------------------------------------------


def test_cpu_events_have_fired_when_recorded_and_time_the_launch() -> None:
    backend = CpuBackend()
    assert backend.synchronous and backend.device == torch.device("cpu")
    with backend.launch():
        start = backend.record("start")
        copied = backend.record("copied")
        done = backend.record("done")
    assert start.query() and copied.query() and done.query()
    assert isinstance(start, Fired) and isinstance(done, Fired)
    assert backend.elapsed_s(start, done) == done.at_s - start.at_s >= 0
    assert not backend.host_empty((2, 3), torch.float32).is_pinned()
    with pytest.raises(TypeError):
        backend.elapsed_s(start, object())  # type: ignore[arg-type]


def test_backend_for_picks_the_backend_by_device_type(fake_cuda: FakeCuda) -> None:
    assert isinstance(backend_for(torch.device("cpu"), 2), CpuBackend)
    cuda = backend_for(torch.device("cuda", 1), 3)
    assert isinstance(cuda, CudaBackend) and not cuda.synchronous
    assert [s.device for s in fake_cuda.streams] == [torch.device("cuda", 1)] * 3
    with pytest.raises(ValueError, match="cpu, cuda"):
        backend_for(torch.device("meta"), 2)
    with pytest.raises(ValueError, match="streams"):
        CudaBackend(torch.device("cuda", 0), 0)


# -- the CUDA backend with a fake torch.cuda ------------------------------------------------------


@dataclass
class FakeStream:
    device: torch.device


@dataclass
class FakeCuda:
    """The part of ``torch.cuda`` the CUDA backend calls. Events fire when the test says so
    (``fire``), or at once with ``auto_fire``; each records the fake clock (1 ms per event)."""

    auto_fire: bool = True
    streams: list[FakeStream] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)
    calls: list[tuple[str, object]] = field(default_factory=list)
    current: FakeStream | None = None
    register_code: int = 0
    clock_ms: float = 0.0
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # ptr -> bytes, flags

    def Stream(self, device: torch.device) -> FakeStream:  # torch.cuda's name
        self.streams.append(FakeStream(device))
        return self.streams[-1]

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def set_device(self, device: torch.device) -> None:
        self.calls.append(("set_device", (device, threading.current_thread().name)))

    def synchronize(self, device: torch.device | None = None) -> None:
        self.calls.append(("synchronize", device))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def cudart(self) -> FakeCuda:
        return self

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # the CUDA runtime's name
        self.calls.append(("cudaHostRegister", nbytes))
        self.registered[ptr] = (nbytes, flags)
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:  # the CUDA runtime's name
        self.calls.append(("cudaHostUnregister", self.registered.pop(ptr)[0]))
        return 0

    def fire(self, *events: FakeEvent) -> None:
        for event in events:
            event.fired.set()


class FakeEvent:
    """A ``torch.cuda.Event`` (the fixture binds ``cuda``)."""

    cuda: FakeCuda

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.timing = enable_timing
        self.blocking = blocking
        self.fired = threading.Event()
        if self.cuda.auto_fire:
            self.fired.set()
        self.queries = 0
        self.waiting = threading.Event()  # a thread waits in synchronize()
        self.stream: FakeStream | None = None
        self.at_ms = 0.0
        self.cuda.events.append(self)

    def record(self, stream: FakeStream) -> None:
        assert stream is self.cuda.current, "recorded on a stream that is not current"
        self.stream = stream
        self.cuda.clock_ms += 1.0
        self.at_ms = self.cuda.clock_ms

    def query(self) -> bool:
        self.queries += 1
        return self.fired.is_set()

    def synchronize(self) -> None:
        assert self.blocking, "a wait on an event that spins instead of sleeping"
        self.waiting.set()
        assert self.fired.wait(30), "the test never fired the event"

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing and self.fired.is_set() and end.fired.is_set()
        return end.at_ms - self.at_ms


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    event = type("Event", (FakeEvent,), {"cuda": cuda})
    monkeypatch.setattr(torch.cuda, "Event", event)
    for name in ("Stream", "stream", "set_device", "synchronize", "empty_cache", "cudart"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    return cuda


def test_batch_k_runs_on_stream_k_mod_n_with_its_events_recorded_there(
    fake_cuda: FakeCuda,
) -> None:
    backend = CudaBackend(torch.device("cuda", 0), 2)
    for _ in range(3):
        with backend.launch():
            for mark in ("start", "copied", "done"):
                backend.record(mark)
    first, second = fake_cuda.streams
    events = fake_cuda.events
    assert [e.stream for e in events] == [first] * 3 + [second] * 3 + [first] * 3
    # start and done time the batch; copied only says when the slab may be reused
    assert [e.timing for e in events[:3]] == [True, False, True]
    start, _, done = events[:3]
    assert backend.elapsed_s(start, done) == pytest.approx(0.002)  # 2 ms apart, in seconds
    with pytest.raises(TypeError):
        backend.elapsed_s(start, Fired(0.0))


def test_cuda_backend_synchronises_and_frees_its_own_device(fake_cuda: FakeCuda) -> None:
    backend = CudaBackend(torch.device("cuda", 1), 2)
    backend.bind_thread()
    backend.synchronize()
    backend.release_memory()
    backend.set_yielding(True)  # nothing to yield on a GPU
    name = threading.current_thread().name
    assert fake_cuda.calls == [
        ("set_device", (torch.device("cuda", 1), name)),
        ("synchronize", torch.device("cuda", 1)),
        ("empty_cache", None),
    ]


def test_register_host_names_the_cuda_error(fake_cuda: FakeCuda) -> None:
    tensor = torch.zeros(4, dtype=torch.float32)
    CudaBackend.register_host(tensor)
    fake_cuda.register_code = 2
    with pytest.raises(RuntimeError, match="cudaHostRegister of 16 bytes failed with CUDA error 2"):
        CudaBackend.register_host(tensor)


class HostCudaBackend(CudaBackend):
    """The CUDA backend with its tensors left on the host: the fake has no pinned memory."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def test_on_cuda_slabs_return_when_copied_fires_and_batches_complete_in_order(
    fake_cuda: FakeCuda,
) -> None:
    """The worker's asynchronous path: the slab thread returns each slab once its copy event
    fired, without waiting for an earlier batch's compute; the completion thread completes
    batches in submission order once their done events fired; the device time is the
    start-to-done event time (the batches do not overlap here)."""
    fake_cuda.auto_fire = False
    pool = StagingPool(2, rows=2, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    host = torch.device("cpu")
    results: queue.Queue[tuple[DeviceResult, np.ndarray, str]] = queue.Queue()

    def on_complete(result: DeviceResult, release: Release) -> None:
        results.put((result, result.outputs[0].copy(), threading.current_thread().name))
        release()

    backend = HostCudaBackend(host, 2)
    worker = DeviceWorker(
        lambda x: (x * 2,), host, pool, 2, 2, on_complete, print, backend, label="cuda:0"
    )
    worker.start()
    for batch_id in (1, 2):
        slab = pool.lease(batch_id=batch_id)
        assert slab is not None
        slab.array[:2] = batch_id
        worker.submit(DeviceJob(batch(batch_id, 2), slab))
    wait_until(lambda: len(fake_cuda.events) == 6, "both batches launched")
    (start1, copied1, done1), (start2, copied2, done2) = (
        fake_cuda.events[:3],
        fake_cuda.events[3:],
    )
    assert start1.stream is not start2.stream  # two streams: copy and compute overlap
    fake_cuda.fire(start1, copied1)
    wait_until(lambda: pool.leak().batch_ids == (2,), "batch 1's slab back before its compute")
    fake_cuda.fire(start2, copied2)  # batch 1 still computing (done1 not fired)
    wait_until(lambda: pool.in_use == 0, "batch 2's slab back while batch 1 computes")
    fake_cuda.fire(done2)
    assert results.empty()  # batch 1 first
    fake_cuda.fire(done1)
    handed = [results.get(timeout=10) for _ in range(2)]
    worker.close()
    assert [r.batch.batch_id for r, _, _ in handed] == [1, 2]
    assert {thread for _, _, thread in handed} == {"completion-cuda:0"}
    for batch_id, (result, outputs, _) in enumerate(handed, 1):
        np.testing.assert_array_equal(outputs, np.full((2, 2), 2.0 * batch_id))
        assert result.inference_s == pytest.approx(0.002)  # start to done, 2 fake ms
    assert pool.in_use == 0 and worker.output_leak().missing == 0
    bound = {call[1] for call in fake_cuda.calls if call[0] == "set_device"}
    assert bound == {(host, f"{role}-cuda:0") for role in ("device", "completion", "slabs")}


# -- issue 29: the CUDA path before a GPU runs it -------------------------------------------------


class RecordingCudaBackend(HostCudaBackend):
    """:class:`HostCudaBackend` noting the thread of every output buffer allocation."""

    def __init__(self, device: torch.device, streams: int) -> None:
        super().__init__(device, streams)
        self.allocated_on: list[str] = []

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.allocated_on.append(threading.current_thread().name)
        return super().host_empty(shape, dtype)


def cuda_worker(
    fake_cuda: FakeCuda, model: object, rows: int = 4, on_complete: object = None
) -> tuple[DeviceWorker, RecordingCudaBackend, StagingPool]:
    pool = StagingPool(3, rows=rows, item_shape=(2,), dtype=np.dtype(np.float32), pin=False)
    backend = RecordingCudaBackend(torch.device("cpu"), 2)
    worker = DeviceWorker(
        model,  # type: ignore[arg-type]
        backend.device,
        pool,
        2,
        2,
        on_complete or (lambda result, release: release()),  # type: ignore[arg-type]
        print,
        backend,
        label="cuda:0",
    )
    return worker, backend, pool


def test_warm_up_runs_on_the_device_thread_on_every_stream_and_allocates_the_outputs(
    fake_cuda: FakeCuda,
) -> None:
    # Issue 29: warm-up ran on the starting thread and the default stream, so the first live
    # batches on each stream allocated (the caching allocator is per stream) and created their
    # per-thread handles; the output buffers were allocated lazily by the first batches.
    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stream = next(i for i, st in enumerate(fake_cuda.streams) if st is fake_cuda.current)
        fake_cuda.calls.append(("model", (x.shape[0], stream, threading.current_thread().name)))
        return (x.sum(dim=1),)

    worker, backend, _ = cuda_worker(fake_cuda, model, rows=4)
    worker.start()
    try:
        runs = [args for name, args in fake_cuda.calls if name == "model"]
        # every size (1, 2, 4) once per stream, all on the device thread
        assert sorted((n, stream) for n, stream, _ in runs) == [
            (n, stream) for n in (1, 2, 4) for stream in (0, 1)
        ]
        assert {thread for _, _, thread in runs} == {"device-cuda:0"}
        names = [name for name, _ in fake_cuda.calls]
        # bound to its GPU before the first model call; no cache released (empty_cache frees
        # every GPU's blocks: it would undo the warm-up of workers started before)
        first = names.index("model")
        device_bound = [
            i for i, (name, args) in enumerate(fake_cuda.calls)
            if name == "set_device" and args[1] == "device-cuda:0"  # type: ignore[index]
        ]  # fmt: skip
        assert device_bound and device_bound[0] < first
        assert "empty_cache" not in names
        # both output buffer sets exist before the first batch, allocated there
        assert worker.output_allocations == 2
        assert backend.allocated_on == ["device-cuda:0"] * 2
    finally:
        worker.close()


def test_calibration_times_the_live_launch_with_its_events_on_the_device_thread(
    fake_cuda: FakeCuda,
) -> None:
    # Issue 29: time_batch ran on the calling thread, timed by the host's wall clock, with no
    # copy back: another scale than the live start -> done events it calibrates against.
    threads: list[str] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        threads.append(threading.current_thread().name)
        return (x.sum(dim=1),)

    worker, _, pool = cuda_worker(fake_cuda, model)
    worker.start()
    threads.clear()
    events_before = len(fake_cuda.events)
    seconds = worker.time_batch(3)
    worker.close()
    start, _, done = fake_cuda.events[events_before:]
    assert seconds == pytest.approx((done.at_ms - start.at_ms) / 1000.0)  # the fake clock
    assert seconds == pytest.approx(0.002)
    assert threads == ["device-cuda:0"]
    assert pool.in_use == 0 and worker.output_leak().missing == 0
    with pytest.raises(RuntimeError, match="not running"):
        worker.time_batch(3)


def test_device_time_is_the_service_time_when_two_streams_overlap(fake_cuda: FakeCuda) -> None:
    # Issue 29: batch 2 starts at 2 ms on the second stream while batch 1 (0 -> 10 ms) runs,
    # and is done at 14 ms: start -> done says 12 ms, but the device served it 4 ms alone.
    # Summed start -> done times (22 ms) exceeded the 14 ms the device was busy.
    fake_cuda.auto_fire = False
    results: queue.Queue[DeviceResult] = queue.Queue()

    def on_complete(result: DeviceResult, release: Release) -> None:
        release()
        results.put(result)

    worker, _, pool = cuda_worker(fake_cuda, lambda x: (x * 2,), on_complete=on_complete)
    worker.start()
    for batch_id in (1, 2):
        slab = pool.lease(batch_id=batch_id)
        assert slab is not None
        worker.submit(DeviceJob(batch(batch_id, 2), slab))
    wait_until(lambda: len(fake_cuda.events) == 6, "both batches launched")
    (start1, copied1, done1), (start2, copied2, done2) = (
        fake_cuda.events[:3],
        fake_cuda.events[3:],
    )
    for event, at_ms in ((start1, 0), (copied1, 1), (done1, 10), (start2, 2), (copied2, 3)):
        event.at_ms = at_ms
    done2.at_ms = 14
    fake_cuda.fire(*fake_cuda.events)
    served = [results.get(timeout=10).inference_s for _ in range(2)]
    worker.close()
    assert served == [pytest.approx(0.010), pytest.approx(0.004)]
    assert sum(served) == pytest.approx(0.014)  # never more than the device was busy


def test_service_time_arithmetic() -> None:
    assert service_s(0.012, None) == 0.012  # the first batch: its own start -> done
    assert service_s(0.012, 0.004) == 0.004  # overlapped the previous batch
    assert service_s(0.003, 0.050) == 0.003  # the device idled in between
    assert service_s(0.012, -0.001) == 0.0  # finished before the previous one


def test_the_completion_and_slab_threads_sleep_on_the_events_never_poll(
    fake_cuda: FakeCuda,
) -> None:
    # Issue 29: the completion thread polled every 0.2 ms (about 5,000 wake-ups a second per
    # lane and device, each taking the GIL) while a batch ran.
    fake_cuda.auto_fire = False
    worker, _, pool = cuda_worker(fake_cuda, lambda x: (x * 2,))
    worker.start()
    slab = pool.lease(batch_id=1)
    assert slab is not None
    worker.submit(DeviceJob(batch(1, 2), slab))
    wait_until(lambda: len(fake_cuda.events) == 3, "the batch launched")
    start, copied, done = fake_cuda.events
    wait_until(lambda: copied.waiting.is_set(), "the slab thread waiting on the copy")
    fake_cuda.fire(start, copied)
    wait_until(lambda: done.waiting.is_set(), "the completion thread waiting on done")
    assert copied.blocking and done.blocking  # a waiting thread sleeps in the driver
    assert done.queries == 0 and start.queries == 0  # blocked, not polling
    fake_cuda.fire(done)
    wait_until(worker.idle, "the batch completed")
    worker.close()


def test_pinned_memory_is_registered_at_its_exact_size_and_unregistered_after_the_device(
    fake_cuda: FakeCuda,
) -> None:
    # Issue 29: pin_memory=True rounds each allocation up to a power of two in torch's caching
    # host allocator: a 9.6 MB slab pinned 16 MB (and pinned memory cannot be swapped).
    pool = StagingPool(2, rows=100, item_shape=(96, 250), dtype=np.dtype(np.float32), pin=True)
    assert sorted(fake_cuda.registered.values()) == [(9_600_000, 1)] * 2  # exact, portable
    held = pool.lease(batch_id=5)  # a copy may still be in flight from it at close
    assert held is not None
    with structlog.testing.capture_logs() as logs:
        pool.close()
    assert list(fake_cuda.registered) == [held.tensor.data_ptr()]  # the free one only
    assert [e["batch_id"] for e in logs if "still leased" in e["event"]] == [5]

    backend = CudaBackend(torch.device("cuda", 0), 2)
    out = backend.host_empty((300, 1000), torch.float32)
    assert fake_cuda.registered[out.data_ptr()] == (1_200_000, 1)
    assert out.shape == (300, 1000) and out.dtype == torch.float32
    fake_cuda.calls.clear()
    backend.close()
    assert [name for name, _ in fake_cuda.calls] == ["synchronize", "cudaHostUnregister"]
    assert out.data_ptr() not in fake_cuda.registered
