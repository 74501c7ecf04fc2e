"""The CUDA backend on a real GPU: a small model through the device worker on ``cuda:0`` gives
the CPU's results, with pinned staging and output buffers, streams, events and the completion
thread; every buffer comes back."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.device.backend import CudaBackend
from streamproc.records import Batch, Record, TopicPartition

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
ROWS = 16
FEATURES = 12
SIZES = (16, 3, 1, 9, 16, 5, 12, 2)  # batch sizes, in submission order


def small_model(device: torch.device) -> torch.nn.Module:
    """The same weights on every device (seeded), two outputs of different shapes."""
    torch.manual_seed(24)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    return net.to(device).eval()


def run(device: torch.device, pin: bool) -> tuple[list[tuple[np.ndarray, ...]], list[str]]:
    """Every batch of ``SIZES`` through a device worker on ``device``; returns the outputs (copied
    before release) in completion order and the threads that completed them."""
    net = small_model(device)

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (net(x), x.sum(dim=1))

    pool = StagingPool(4, ROWS, (FEATURES,), np.dtype(np.float32), pin=pin)
    completed: queue.Queue[tuple[DeviceResult, tuple[np.ndarray, ...], str]] = queue.Queue()
    errors: list[BaseException] = []

    def on_complete(result: DeviceResult, release: Release) -> None:
        outputs = tuple(o.copy() for o in result.outputs)  # valid only until release()
        completed.put((result, outputs, threading.current_thread().name))
        release()

    worker = DeviceWorker(model, device, pool, 2, 2, on_complete, errors.append)
    worker.start()
    assert worker.time_batch(ROWS) > 0
    rng = np.random.default_rng(24)
    tp = TopicPartition("t", 0)
    for batch_id, n in enumerate(SIZES, 1):
        slab = pool.lease(batch_id=batch_id)
        assert slab is not None and slab.tensor.is_pinned() == pin
        slab.array[:n] = rng.standard_normal((n, FEATURES), dtype=np.float32)
        records = tuple(Record(tp, i, None, b"v", (), 0, 0.0, 1) for i in range(n))
        worker.submit(DeviceJob(Batch(batch_id, records, 0.0), slab))
    done = [completed.get(timeout=60) for _ in SIZES]
    worker.close()
    assert not errors
    results = [result for result, _, _ in done]
    assert [r.batch.batch_id for r in results] == list(range(1, len(SIZES) + 1))
    assert all(r.error is None and not r.failed and r.inference_s > 0 for r in results)
    assert pool.in_use == 0 and pool.leak().missing == 0 and worker.output_leak().missing == 0
    pool.close()
    return [outputs for _, outputs, _ in done], [thread for _, _, thread in done]


def test_a_small_model_on_the_cuda_worker_gives_the_cpu_results() -> None:
    on_gpu, gpu_threads = run(CUDA, pin=True)
    on_cpu, cpu_threads = run(CPU, pin=False)
    assert set(gpu_threads) == {"completion-cuda:0"}  # events polled off the device thread
    assert set(cpu_threads) == {"device-cpu"}
    for gpu, cpu, n in zip(on_gpu, on_cpu, SIZES, strict=True):
        assert [o.shape for o in gpu] == [(n, 4), (n,)] == [o.shape for o in cpu]
        for g, c in zip(gpu, cpu, strict=True):
            np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-4)


def test_pinned_buffers_of_the_cuda_backend() -> None:
    backend = CudaBackend(CUDA, 2)
    assert backend.host_empty((4, 3), torch.float32).is_pinned()
    shared = StagingPool(2, ROWS, (FEATURES,), np.dtype(np.float32), pin=True, shared=True)
    try:
        slab = shared.lease()
        assert slab is not None and slab.tensor.is_pinned()  # page-locked in place
        shared.release(slab)
        del slab  # no view left: the shared memory closes
    finally:
        shared.close()  # unregisters before the shared memory goes
