"""One device's runtime: staging buffers (pinned when CUDA is present), device backends (CPU;
CUDA streams and events), device workers (launch, part runner, hold, warm-up, completion).
Which batch goes where, and when, is :mod:`streamproc.dispatch`'s; the results' order back is
:mod:`streamproc.output.resequencer`'s."""

from streamproc.device.backend import CpuBackend, CudaBackend, DeviceBackend
from streamproc.device.jobs import DeviceJob, DeviceResult, Release
from streamproc.device.staging import PoolLeak, Slab, StagingPool
from streamproc.device.worker import DeviceWorker

__all__ = [
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "DeviceJob",
    "DeviceResult",
    "DeviceWorker",
    "PoolLeak",
    "Release",
    "Slab",
    "StagingPool",
]
