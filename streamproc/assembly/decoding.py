"""The decode workers every lane shares: a strategy chosen once from ``worker.decode_mode``.

:class:`ThreadDecoding` (``thread``) and :class:`ProcessDecoding` (``process``) build each
pipeline's decoder, say whether staging slabs must live in shared memory, and start and close
their workers with the :class:`~streamproc.decode.sizing.DecodeSizer` that resizes them between
``worker.decode_workers_min`` and ``decode_workers_max``. Nothing else branches on the mode.
"""

from __future__ import annotations

from typing import Any, Protocol

from streamproc.config.sections import PipelineConfig, WorkerConfig
from streamproc.decode import (
    DecodeProcesses,
    Decoder,
    DecodeRoutePolicy,
    DecodeSizer,
    DecodeSizingPolicy,
    DecodeSpec,
    DecodeThreads,
    ProcessDecoder,
    ThreadDecoder,
)
from streamproc.device import StagingPool
from streamproc.metrics import Metrics
from streamproc.workloads import Workload


class Decoding(Protocol):
    """The decode workers shared by every lane, and the sizer that resizes them."""

    sizer: DecodeSizer
    shared_staging: bool
    """Staging slabs must live in shared memory (decode processes write into them)."""

    def decoder(self, spec: PipelineConfig, workload: Workload, staging: StagingPool) -> Decoder:
        """The decoder of one pipeline, writing rows into its ``staging`` slabs."""
        ...

    def start(self) -> None:
        """Start the workers that need starting, then the sizer's thread."""
        ...

    def close(self) -> None:
        """Stop the sizer, then the workers."""
        ...


def build_decoding(
    worker: WorkerConfig,
    metrics: Metrics,
    registry: dict[str, Any] | None = None,
    registry_backoff_s: tuple[float, float] = (0.1, 5.0),
) -> Decoding:
    """The decode workers of ``worker.decode_mode``, ``decode_workers_start`` of them;
    ``registry``: the Schema Registry client settings decode processes build their own writer
    schemas from (None without a schema-managed pipeline)."""
    if worker.decode_mode == "process":
        return ProcessDecoding(worker, metrics, registry or {}, registry_backoff_s)
    return ThreadDecoding(worker, metrics)


def _sizer(
    pool: DecodeThreads | DecodeProcesses, worker: WorkerConfig, metrics: Metrics
) -> DecodeSizer:
    low, high = worker.decode_workers_bounds
    return DecodeSizer(pool, DecodeSizingPolicy(low, high, worker.decode_workers_start), metrics)


class ThreadDecoding:
    """``worker.decode_mode: thread``: decode threads; where ``worker.decode_inline`` allows, a
    lane decodes on its dispatcher thread instead (``streamproc_decode_inline{topic}``)."""

    shared_staging = False

    def __init__(self, worker: WorkerConfig, metrics: Metrics) -> None:
        self.threads = DecodeThreads(worker.decode_workers_start)
        self.sizer = _sizer(self.threads, worker, metrics)
        self._worker = worker
        self._metrics = metrics

    def decoder(self, spec: PipelineConfig, workload: Workload, staging: StagingPool) -> Decoder:
        topic, inline = spec.input_topic, self._worker.decode_inline
        gauge = self._metrics.decode_inline.labels(topic)
        return ThreadDecoder(
            workload,
            self.threads,
            self._worker.max_message_bytes,
            lane=topic,
            on_sample=self.sizer.observe,
            route=(
                DecodeRoutePolicy()
                if inline == "auto"
                else ("inline" if inline == "always" else "pool")
            ),
            on_route=lambda route: gauge.set(route == "inline"),
        )

    def start(self) -> None:
        self.sizer.start()

    def close(self) -> None:
        self.sizer.close()
        self.threads.shutdown(wait=True, cancel_futures=True)


class ProcessDecoding:
    """``worker.decode_mode: process``: decode processes, each writing rows straight into the
    shared-memory staging slabs of the pipelines registered with them."""

    shared_staging = True

    def __init__(
        self,
        worker: WorkerConfig,
        metrics: Metrics,
        registry: dict[str, Any] | None = None,
        registry_backoff_s: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        self._registry = registry or {}
        self._registry_backoff_s = registry_backoff_s
        self.processes = DecodeProcesses(worker.decode_workers_start)
        self.sizer = _sizer(self.processes, worker, metrics)
        self._max_message_bytes = worker.max_message_bytes

    def decoder(self, spec: PipelineConfig, workload: Workload, staging: StagingPool) -> Decoder:
        topic = spec.input_topic
        self.processes.register(
            topic,
            DecodeSpec(
                spec.workload,
                dict(spec.options),
                staging.shared_names,
                staging.shape,
                staging.dtype.str,
                spec.format,
                self._registry,
                self._registry_backoff_s,
            ),
        )
        return ProcessDecoder(
            self.processes, topic, self._max_message_bytes, on_sample=self.sizer.observe
        )

    def start(self) -> None:
        self.processes.start()
        self.sizer.start()

    def close(self) -> None:
        self.sizer.close()
        self.processes.close()
