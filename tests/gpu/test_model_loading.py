"""Loading a model version on a real GPU (issue 39, item 5): the warm-up's input is filled in
stream order before the model reads it, a version is handed over only once the work queued
while loading it is done, and the memory check counts PyTorch's cached-but-free blocks as free.

Each test first queues a long kernel (``torch.cuda._sleep``) on the loading thread's current
stream: what loading does not order after it, it races (the CPU tier,
``tests/unit/models/test_cuda_accounting.py``, checks the accounting with injected numbers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamproc.device.backend import free_memory_bytes
from streamproc.models.loading import load_version, output_signature
from streamproc.models.sources import FolderSource
from streamproc.workloads.iot import IotWorkload
from tests.support.model_versions import iot_module, write_version

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
ROWS = 8
SLEEP_CYCLES = 10_000_000_000  # some 5 s of one GPU thread spinning: longer than a load
MIB = 1 << 20


def test_the_warm_up_reads_its_zeros_after_the_work_queued_before_it() -> None:
    workload = IotWorkload()
    torch.cuda.synchronize(CUDA)
    # the block the warm-up's largest input will get from the cache, left full of ones
    ones = torch.ones((ROWS, *workload.item_shape), device=CUDA)
    del ones
    seen: list[float] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen.append(float(x.abs().sum()))  # waits for the calling stream only
        return (x.reshape(x.shape[0], -1)[:, 0],)

    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # on the current stream
    output_signature(model, workload, CUDA, ROWS)
    assert seen and all(total == 0.0 for total in seen), seen


def test_a_version_is_handed_over_once_the_work_queued_while_loading_is_done(
    tmp_path: Path,
) -> None:
    write_version(tmp_path, "1", iot_module())
    files = FolderSource(tmp_path, "iot").fetch("1")
    workload = IotWorkload()
    torch.cuda.synchronize(CUDA)
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # on the current stream
    loaded = load_version(files, workload, [CUDA], "fp32", ROWS)
    assert torch.cuda.current_stream(CUDA).query(), "handed over with work still queued"
    x = torch.rand((ROWS, *workload.item_shape))
    expected = workload.build_model(torch.device("cpu"))(x)
    other = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]  # a device thread's
    with torch.cuda.stream(other):
        got = loaded.fns[0](x.to(CUDA))
    other.synchronize()
    assert torch.allclose(got[0].cpu(), expected[0], atol=1e-5)
    assert torch.equal(got[1].cpu(), expected[1])


def test_the_memory_check_counts_the_caching_allocators_free_blocks() -> None:
    torch.cuda.synchronize(CUDA)
    torch.cuda.empty_cache()  # the block below comes from the driver, not an earlier test's
    before = free_memory_bytes(CUDA)
    block = torch.empty(512 * MIB, dtype=torch.uint8, device=CUDA)
    del block  # back in PyTorch's cache, not the driver's
    torch.cuda.synchronize(CUDA)
    driver_free = torch.cuda.mem_get_info(CUDA)[0]
    assert driver_free <= before - 448 * MIB  # the driver counts the cached block as used
    assert free_memory_bytes(CUDA) >= before - 64 * MIB  # the check counts it free
