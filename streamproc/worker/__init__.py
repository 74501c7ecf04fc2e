"""Device side: pinned staging pool, device worker with streams/events, completion thread."""

from streamproc.worker.device import DeviceJob, DeviceResult, DeviceWorker
from streamproc.worker.pool import Slab, StagingPool

__all__ = ["DeviceJob", "DeviceResult", "DeviceWorker", "Slab", "StagingPool"]
