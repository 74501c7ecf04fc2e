"""Device side: staging pool, device workers with streams/events and completion threads, and the
resequencer that hands a lane's results over in cut order."""

from streamproc.worker.device import DeviceJob, DeviceResult, DeviceWorker, Release
from streamproc.worker.pool import PoolLeak, Slab, StagingPool
from streamproc.worker.resequencer import Resequencer

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
