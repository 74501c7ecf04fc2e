"""The model's runs before traffic, on zero rows, synchronously on the calling thread (the
starting thread, before the device thread starts): the warm-up, and the start-up timings the
adaptive batch size is calibrated on.

The staging slab they run on is leased from the worker's pool and given back before they
return (after the device is synchronised: nothing still reads it).
"""

from __future__ import annotations

import time

import torch

from streamproc.device.backend import DeviceBackend
from streamproc.device.recovery import DeviceOutOfMemoryError, PartRunner, is_out_of_memory
from streamproc.device.staging import Slab, StagingPool
from streamproc.errors import ModelError
from streamproc.logs import get_logger
from streamproc.workloads.base import ModelFn

log = get_logger(__name__)


def warm_up(model: ModelFn, backend: DeviceBackend, pool: StagingPool, label: str) -> int | None:
    """Run ``model`` once per batch size the adaptive batcher may try (powers of two up to the
    slab's rows, and the rows) on zeros: the first call of a new shape pays one-off costs
    (oneDNN primitives, cuDNN autotuning) that would otherwise skew the batcher's first
    measurements and the first batches' latency.

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
            fits = 0
            for size in sizes:
                try:
                    model(slab.tensor[:size].to(backend.device))
                except Exception as exc:
                    if is_out_of_memory(exc):
                        break
                    if size == rows:
                        raise  # the full batch fails on zeros: the model is unusable
                    log.warning("model warm-up failed", batch_size=size, error=repr(exc))
                fits = size
            else:
                return None
            backend.release_memory()
            largest = _largest_fit(model, backend, slab, fits, size, label)
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
            model(slab.tensor[:size].to(backend.device))
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


def time_batch(
    model: ModelFn, backend: DeviceBackend, pool: StagingPool, runner: PartRunner, size: int
) -> float:
    """Device seconds of ``model`` on one batch of ``size`` zero rows: copy in, model,
    device synchronised. A batch that runs out of memory runs in parts through ``runner`` (as
    a live batch would, lowering its cap); the time covers them all.

    Raises:
        ValueError: ``size`` is not within 1..the staging slab's rows.
        ModelError: the model raised on zeros.
    """
    if not 1 <= size <= pool.rows:
        raise ValueError(f"batch size {size} outside 1..{pool.rows}")
    slab = pool.lease()
    assert slab is not None
    try:
        slab.array[:size] = 0
        with torch.inference_mode():
            started_s = time.perf_counter()
            x = slab.tensor[:size].to(backend.device)
            outcome = runner.run(size, lambda lo, hi: _discard(model(x[lo:hi])))
            backend.synchronize()
            seconds = time.perf_counter() - started_s
        if outcome.failed:
            raise ModelError(f"model failed on zeros: {next(iter(outcome.failed.values()))}")
        return seconds
    finally:
        pool.release(slab)


def _discard(outputs: tuple[torch.Tensor, ...]) -> None:
    """A timing run's outputs are not kept."""
