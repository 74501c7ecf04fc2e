"""Result handling: encode each output row and hand it to the sink, in batch order.

Runs on the device worker's completion thread. Rows whose decode failed, or whose batch the
model failed on, or whose encode raises, become dead-letter records with the stage and reason.
"""

from __future__ import annotations

import threading

from streamproc.config import PipelineConfig
from streamproc.errors import RecordError
from streamproc.metrics import Metrics
from streamproc.records import Record
from streamproc.sink import H_INFERENCE_MS, H_QUEUE_MS, Sink
from streamproc.worker import DeviceResult
from streamproc.workloads import Workload


class ResultHandler:
    """Turns a :class:`DeviceResult` into produced records for one pipeline.

    Args:
        pipeline: the pipeline's config (output and dead-letter topics).
        workload: encoder.
        sink: producer.
        slots: the dispatcher's in-flight semaphore, released once per batch.
        metrics: process metrics.
    """

    def __init__(
        self,
        pipeline: PipelineConfig,
        workload: Workload,
        sink: Sink,
        slots: threading.Semaphore,
        metrics: Metrics,
    ) -> None:
        self._pipeline = pipeline
        self._workload = workload
        self._sink = sink
        self._slots = slots
        self._metrics = metrics

    def __call__(self, result: DeviceResult) -> None:
        try:
            self._handle(result)
        finally:
            self._slots.release()

    def _handle(self, result: DeviceResult) -> None:
        topic = self._pipeline.input_topic
        dlq = self._pipeline.dead_letter_topic
        self._metrics.inference.labels(topic).observe(result.inference_s)
        inference_ms = f"{result.inference_s * 1000:.3f}".encode()
        for row, record in enumerate(result.batch.records):
            error: RecordError | None = result.failed.get(row) or result.error
            if error is None:
                try:
                    encoded = self._workload.encode(
                        record, tuple(out[row] for out in result.outputs)
                    )
                except Exception as exc:
                    self._dead_letter(record, dlq, "encode", exc)
                    continue
                queue_ms = f"{(result.batch.cut_at_s - record.consumed_at_s) * 1000:.3f}"
                self._sink.send_result(
                    record,
                    self._pipeline.output_topic,
                    encoded.value,
                    (
                        *encoded.headers,
                        (H_INFERENCE_MS, inference_ms),
                        (H_QUEUE_MS, queue_ms.encode()),
                    ),
                    dlq,
                )
            else:
                self._dead_letter(record, dlq, error.stage, error)

    def _dead_letter(self, record: Record, dlq: str, stage: str, exc: BaseException) -> None:
        self._sink.dead_letter(record, dlq, stage, type(exc).__name__, str(exc))
