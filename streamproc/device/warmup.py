"""The model's runs before traffic, on zero rows, on the worker's device thread (asked for by
:meth:`~streamproc.device.DeviceWorker.start` and :meth:`~streamproc.device.DeviceWorker.time_batch`
and waited for there): the warm-up, and the start-up timings the adaptive batch size is
calibrated on.

They run where live batches run, so that they warm what live batches use: on the device thread
(its current device, its per-thread cuBLAS/cuDNN handles) and, for every size, on each of the
backend's streams (the caching allocator keeps blocks per stream); the output buffer sets are
allocated there too. The timings go through the live launch
(:meth:`~streamproc.device.launch.Launcher.run`: copy in, model, copy out into the pinned
outputs) and its events, so calibration and live device times are on one scale.

The staging slab they run on is leased from the worker's pool and given back before they
return (after the device is synchronised: nothing still reads it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamproc.device.backend import DeviceBackend
from streamproc.device.launch import Launcher
from streamproc.device.outputs import OutputSets
from streamproc.device.recovery import DeviceOutOfMemoryError, is_out_of_memory
from streamproc.device.staging import Slab, StagingPool
from streamproc.errors import ModelError
from streamproc.logs import get_logger
from streamproc.workloads.base import ModelFn

log = get_logger(__name__)


def warm_up(
    model: ModelFn,
    backend: DeviceBackend,
    pool: StagingPool,
    label: str,
    prepare: Callable[[tuple[torch.Tensor, ...]], None],
) -> int | None:
    """Run ``model`` once per batch size the adaptive batcher may try (powers of two up to the
    slab's rows, and the rows) and per stream of ``backend``, on zeros: the first call of a
    new shape pays one-off costs (oneDNN primitives, cuDNN algorithm selection, the stream's first
    allocations) that would otherwise skew the batcher's first measurements and the first
    batches' latency. ``prepare`` gets the outputs of the largest batch that ran (the output
    buffer sets are allocated from them).

    The cache is not released around the warm-up: ``torch.cuda.empty_cache()`` frees every
    stream's and every GPU's unused blocks, so it would undo the warm-up of the workers started
    before (what model loading left on the default stream stays cached).

    A size that runs out of device memory ends the warm-up there: the largest batch that fits
    is found by bisection between the last size that ran and that one, and one warning says so.

    Returns:
        None when every size ran, else the largest batch (rows) that fits.

    Raises:
        DeviceOutOfMemoryError: not even one row fits on the device (``label`` names it).
        Exception: whatever the model raised on the largest size tried (on zeros: the model
            is unusable).
    """
    slab = pool.lease()
    assert slab is not None
    rows = pool.rows
    sizes = sorted({*(2**i for i in range(rows.bit_length()) if 2**i <= rows), rows})
    try:
        slab.array[...] = 0
        with torch.inference_mode():
            fits, ran = 0, None
            for size in sizes:
                try:
                    ran = _on_every_stream(model, backend, slab, size)
                except Exception as exc:
                    if is_out_of_memory(exc):
                        break
                    if size == rows:
                        raise  # the full batch fails on zeros: the model is unusable
                    log.warning("model warm-up failed", batch_size=size, error=repr(exc))
                fits = size
            else:
                if ran is not None:
                    prepare(ran)
                return None
            backend.release_memory()
            largest = _largest_fit(model, backend, slab, fits, size, label)
            if ran is not None:
                prepare(ran)
        log.warning(
            "batch size capped: the device ran out of memory at warm-up",
            device=label,
            out_of_memory_at=size,
            batch_size_cap=largest,
        )
        return largest
    finally:
        backend.synchronize()
        pool.release(slab)


def _largest_fit(
    model: ModelFn, backend: DeviceBackend, slab: Slab, fits: int, fails: int, label: str
) -> int:
    """The largest batch in ``fits..fails-1`` that runs without running out of memory
    (``fits`` rows ran, ``fails`` rows did not), by bisection on zeros."""
    while fails - fits > 1:
        size = (fits + fails) // 2
        try:
            _on_every_stream(model, backend, slab, size)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            fails = size
            out_of_memory = True
        else:
            fits = size
            out_of_memory = False
        if out_of_memory:
            backend.release_memory()
    if fits == 0:
        raise DeviceOutOfMemoryError(
            f"device {label} is out of memory at warm-up for a batch of one row: "
            "the model does not fit"
        )
    return fits


def _on_every_stream(
    model: ModelFn, backend: DeviceBackend, slab: Slab, size: int
) -> tuple[torch.Tensor, ...]:
    """``model`` on rows ``0..size-1`` of ``slab``, once in a launch on each stream; the last
    call's outputs."""
    outputs: tuple[torch.Tensor, ...] = ()
    for _ in range(backend.streams):
        with backend.launch():
            outputs = model(slab.tensor[:size].to(backend.device, non_blocking=True))
    return outputs


def time_batch(
    model: ModelFn,
    backend: DeviceBackend,
    launcher: Launcher,
    pool: StagingPool,
    outputs: OutputSets,
    size: int,
) -> float:
    """Device seconds of ``model`` on one batch of ``size`` zero rows, from the events of a live
    launch (:meth:`Launcher.run`: copy in, model, copy out; ``start`` to ``done``). A batch that
    runs out of memory runs in parts (as a live batch would, lowering the cap); the time
    covers them all.

    Raises:
        ValueError: ``size`` is not within 1..the staging slab's rows.
        ModelError: the model raised on zeros.
    """
    if not 1 <= size <= pool.rows:
        raise ValueError(f"batch size {size} outside 1..{pool.rows}")
    slab = pool.lease()
    assert slab is not None
    slot = outputs.take(-1)
    try:
        slab.array[:size] = 0
        ran = launcher.run(model, slab.tensor, size, slot)
        ran.done.synchronize()
        if ran.outcome.failed:
            failure = next(iter(ran.outcome.failed.values()))
            raise ModelError(f"model failed on zeros: {failure}")
        return backend.elapsed_s(ran.start, ran.done)
    finally:
        backend.synchronize()  # a failed timing may leave copies of the slab queued
        outputs.give_back(slot)
        pool.release(slab)
