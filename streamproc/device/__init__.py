"""The device stage: device selection and placement, the dispatcher (and a lane's fused route on
one CPU device), admission across lanes, staging buffers (pinned when CUDA is present), device
backends (CPU; CUDA streams and events), device workers, and the resequencer."""

from streamproc.device.backend import CpuBackend, CudaBackend, DeviceBackend
from streamproc.device.jobs import DeviceJob, DeviceResult, Release
from streamproc.device.resequencer import Resequencer
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
    "Resequencer",
    "Slab",
    "StagingPool",
]
