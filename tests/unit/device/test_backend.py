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
from streamproc.device.backend import Fired, backend_for
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
        return self.register_code

    def fire(self, *events: FakeEvent) -> None:
        for event in events:
            event.fired = True


class FakeEvent:
    """A ``torch.cuda.Event`` (the fixture binds ``cuda``)."""

    cuda: FakeCuda

    def __init__(self, enable_timing: bool = False) -> None:
        self.timing = enable_timing
        self.fired = self.cuda.auto_fire
        self.stream: FakeStream | None = None
        self.at_ms = 0.0
        self.cuda.events.append(self)

    def record(self, stream: FakeStream) -> None:
        assert stream is self.cuda.current, "recorded on a stream that is not current"
        self.stream = stream
        self.cuda.clock_ms += 1.0
        self.at_ms = self.cuda.clock_ms

    def query(self) -> bool:
        return self.fired

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing and self.fired and end.fired
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
    """The worker's asynchronous path: a completion thread returns each slab once its copy
    event fired, whatever the batch order, and completes batches in submission order once
    their done events fired; the device time is the start-to-done event time."""
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
    fake_cuda.fire(copied2)
    wait_until(lambda: pool.leak().batch_ids == (1,), "batch 2's slab back before batch 1's")
    fake_cuda.fire(start2, done2)
    assert results.empty()  # batch 1 first
    fake_cuda.fire(start1, copied1, done1)
    handed = [results.get(timeout=10) for _ in range(2)]
    worker.close()
    assert [r.batch.batch_id for r, _, _ in handed] == [1, 2]
    assert {thread for _, _, thread in handed} == {"completion-cuda:0"}
    for batch_id, (result, outputs, _) in enumerate(handed, 1):
        np.testing.assert_array_equal(outputs, np.full((2, 2), 2.0 * batch_id))
        assert result.inference_s == pytest.approx(0.002)  # start to done, 2 fake ms
    assert pool.in_use == 0 and worker.output_leak().missing == 0
    bound = {call[1] for call in fake_cuda.calls if call[0] == "set_device"}
    assert bound == {(host, "device-cuda:0"), (host, "completion-cuda:0")}
