"""The device stage: device selection and placement, the dispatcher, admission across lanes,
staging buffers (pinned when CUDA is present), device workers with streams and events, and the
resequencer."""

from streamproc.device.resequencer import Resequencer
from streamproc.device.staging import PoolLeak, Slab, StagingPool
from streamproc.device.worker import DeviceJob, DeviceResult, DeviceWorker, Release

__all__ = [
    "DeviceJob",
    "DeviceResult",
    "DeviceWorker",
    "PoolLeak",
    "Release",
    "Resequencer",
    "Slab",
    "StagingPool",
]
