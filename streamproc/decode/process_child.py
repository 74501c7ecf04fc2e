"""What runs inside a decode process (the child side of :mod:`streamproc.decode.processes`).

Every function here is module-level so that a ``spawn`` or ``forkserver`` child can import it by
name. The module's global state (each lane's workload and slab views, the shared-memory
mappings) exists only in a decode process: :func:`init_process` fills it once, as the process's
initializer, and the consumer process never touches it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from streamproc.decode.protocol import Failures
from streamproc.decode.rows import decode_rows
from streamproc.records import Record
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads import Workload, load_workload


@dataclass(frozen=True)
class DecodeSpec:
    """What a decode process needs to serve one pipeline: how to build its workload and where
    its staging slabs live.

    Attributes:
        workload: workload name or spec (``load_workload``'s first argument).
        options: workload options.
        input_format: ``pipelines[].format``.
        registry: the ``SchemaRegistryClient`` settings (empty without a registry; holds the
            secret: never logged).
        registry_backoff_s: the first and the longest wait between registry lookups, in seconds
            (``schema_registry.retry_backoff_s``, ``retry_backoff_max_s``).
        slabs: shared-memory name of each slab, in pool index order.
        shape: shape of one slab, ``(rows, *item_shape)``.
        dtype: numpy dtype string of the rows.
    """

    workload: str
    options: dict[str, Any]
    slabs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    input_format: str = "json"
    registry: dict[str, Any] = field(default_factory=dict)
    registry_backoff_s: tuple[float, float] = (0.1, 5.0)


_LANES: dict[str, tuple[Workload, list[np.ndarray]]] = {}
_ATTACHED: list[shared_memory.SharedMemory] = []
_SCHEMAS: WriterSchemas | None = None


def init_process(lanes: dict[str, DecodeSpec], parent_pid: int) -> None:
    """Decode-process initializer: detach from terminal signals, watch the parent, build each
    lane's workload and map its slabs."""
    # Ctrl-C or a stop signal sent to the whole process group must reach only the consumer,
    # which drains and then shuts these processes down; left to the default handlers, they died
    # mid-batch and good records of that batch were dead-lettered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    for name, spec in lanes.items():
        views = []
        for shm_name in spec.slabs:
            shm = shared_memory.SharedMemory(name=shm_name)
            _ATTACHED.append(shm)  # keep the mapping alive; the parent owns (unlinks) it
            views.append(np.ndarray(spec.shape, dtype=np.dtype(spec.dtype), buffer=shm.buf))
        workload = load_workload(spec.workload, spec.options)
        writers = _writer_schemas(spec.registry, spec.registry_backoff_s)
        workload.use_input_format(spec.input_format, writers)
        _LANES[name] = (workload, views)


def _writer_schemas(
    settings: dict[str, Any], backoff_s: tuple[float, float]
) -> WriterSchemas | None:
    """This process's writer schemas (one cache for its lanes), or None without a registry."""
    global _SCHEMAS
    if not settings:
        return None
    if _SCHEMAS is None:
        _SCHEMAS = WriterSchemas(settings, *backoff_s)
    return _SCHEMAS


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit once the consumer process is gone (kill -9, or a second signal's immediate exit):
    a decode process must never outlive it, holding its memory and the shared slabs."""
    while os.getppid() == parent_pid:
        time.sleep(period_s)  # a liveness poll, not synchronisation
    os._exit(0)


def ready() -> int:
    """Warm-up task: proves the process finished its initializer; answers its pid."""
    return os.getpid()


def decode_slice(
    lane: str, slab_index: int, start: int, records: list[Record], skip: set[int]
) -> Failures:
    """:func:`~streamproc.decode.rows.decode_rows` of ``records`` into rows ``start..`` of
    ``lane``'s slab ``slab_index``, in this decode process.

    Raises:
        KeyError: ``lane`` was not registered before the process started.
    """
    workload, views = _LANES[lane]
    return decode_rows(workload, records, views[slab_index], start, skip)
