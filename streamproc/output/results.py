"""Result handling: encode a batch's output rows and hand them to the sink, in batch order.

Runs on the lane's ``results-<topic>`` thread (the resequencer's), one batch at a time in cut
order. Rows whose decode failed, or that the model failed on alone (the device worker narrowed
a failing batch down to them), or whose encode (the result callback) still raises after its
retries, become dead-letter records with the stage and reason; one bad record never stops the
stream, and its offset is committed only once its dead-letter record is acknowledged.

Records past their deadline at the cut (``Batch.expired``, never run) become, by
``pipelines[].on_expired``, an expired result (empty value, ``streamproc.result.kind:
expired``), produced with the batch's results in offset order within each partition, or a
dead-letter record with stage ``deadline``; their offsets commit like any other's once that is
acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from tenacity import Retrying, stop_after_attempt, wait_exponential

from streamproc.config.sections import PipelineConfig
from streamproc.device import DeviceResult
from streamproc.errors import RecordError, RegistryUnavailable
from streamproc.metrics import Metrics
from streamproc.output.headers import (
    STAGE_DEADLINE,
    OutputHeaders,
    ResultHeaders,
)
from streamproc.output.sink import Sink
from streamproc.output.window import AckWindow
from streamproc.records import Headers, Record, Trace
from streamproc.workloads import Encoded, Workload


class ResultHandler:
    """Turns a :class:`DeviceResult` into produced records for one pipeline.

    Args:
        pipeline: the pipeline's config (output and dead-letter topics).
        workload: encoder.
        sink: producer.
        metrics: process metrics.
        attempts: tries per record (the batch's ``workload.encode_many``, then
            ``workload.encode`` alone with backoff 5 ms doubling, at most 100 ms) before the
            record is dead-lettered with stage ``encode``.
        observe: called with (batch size, device seconds) per batch (the adaptive batch size).
        version_of: called with each batch before its results are produced; returns the
            name of the model version that made them (a versioned pipeline's
            :meth:`~streamproc.models.versions.ModelVersions.observe`; None: ``builtin``).
        window: the lane's acknowledgement window: a batch's results wait there while the
            lane's inputs awaiting acknowledgement are at ``buffers.max_unacknowledged_bytes``
            (None: no bound).
    """

    def __init__(
        self,
        pipeline: PipelineConfig,
        workload: Workload,
        sink: Sink,
        metrics: Metrics,
        attempts: int = 3,
        observe: Callable[[int, float], None] | None = None,
        version_of: Callable[[DeviceResult], str] | None = None,
        window: AckWindow | None = None,
    ) -> None:
        self._attempts = attempts
        self._window = window
        self._version_of = version_of
        self._versions: dict[str, bytes] = {}
        self._observe = observe
        self._pipeline = pipeline
        self._workload = workload
        self._sink = sink
        self._metrics = metrics
        self._headers = ResultHeaders(pipeline.input_topic)

    def __call__(self, result: DeviceResult) -> None:
        """Encode and produce one batch's results (dead-letter what failed); what its expired
        records become goes with them.

        Raises:
            RegistryUnavailable: the Schema Registry did not answer an encode before it closed.
            Exception: what the sink raised (a producer that cannot go on): the pipeline stops.
                Either way a traced batch's span ends first, with an error status.
        """
        try:
            self._handle(result)
        except BaseException as exc:
            clock = result.batch.clock
            if clock is not None and clock.trace is not None:
                clock.trace.fail(exc)
            raise

    def _handle(self, result: DeviceResult) -> None:
        topic = self._pipeline.input_topic
        dlq = self._pipeline.dead_letter_topic
        clock = result.batch.clock
        trace = None if clock is None else clock.trace
        if not result.batch.records:  # every record expired at the cut: none ran
            self._send(result, [], [], [])
            return
        exemplar = None
        if trace is not None:
            trace.device_time(result.inference_s)
            exemplar = trace.exemplar
        self._metrics.inference.labels(topic).observe(result.inference_s, exemplar)
        # a batch re-run in parts (its model call raised) measures the re-runs, not its size
        if self._observe is not None and result.error is None and result.model_calls == 1:
            self._observe(len(result.batch), result.inference_s)
        inference_ms = result.inference_s * 1000
        version = self._version(result)
        cut_at_s = result.batch.cut_at_s
        records = result.batch.records
        failed = result.failed
        if result.error is not None:  # no row of the batch ran the model
            for row, record in enumerate(records):
                error = (failed.get(row) if failed else None) or result.error
                self._dead_letter(record, dlq, error.stage, error, trace)
            self._send(result, [], [], [])
            return
        encoded = self._encode_many(records, result.outputs, failed)
        kept: list[Record] = []
        values: list[bytes] = []
        extra: list[Headers] = []
        now_s = time.monotonic()
        for row, (record, value) in enumerate(zip(records, encoded, strict=True)):
            if isinstance(value, RegistryUnavailable):
                raise value  # not the record's fault: never dead-lettered (the lane stops)
            if not isinstance(value, Encoded):
                if value is None:  # its decode failed
                    error = failed[row]
                    self._dead_letter(record, dlq, error.stage, error, trace)
                    continue
                try:
                    value = self._retry_encode(
                        record, tuple(out[row] for out in result.outputs), value
                    )
                except RegistryUnavailable:
                    raise
                except Exception as exc:
                    self._dead_letter(record, dlq, "encode", exc, trace)
                    continue
            kept.append(record)
            values.append(value.value)
            extra.append(value.headers)
        headers = self._headers.build(kept, extra, cut_at_s, inference_ms, now_s, version)
        if trace is not None:
            output_topic = self._pipeline.output_topic
            for record, built in zip(kept, headers, strict=True):
                built.extend(trace.out(record, output_topic))
        self._send(result, kept, values, headers)

    def _send(
        self,
        result: DeviceResult,
        kept: list[Record],
        values: list[bytes],
        headers: list[OutputHeaders],
    ) -> None:
        """Produce the results ``kept`` (with ``values`` and ``headers``) and what the batch's
        expired records become: expired results merged in, in offset order per partition, or
        dead-letter records (stage ``deadline``)."""
        pipeline = self._pipeline
        expired = result.batch.expired
        clock = result.batch.clock
        trace = None if clock is None else clock.trace
        if expired and pipeline.on_expired == "dead_letter":
            cut_at_s = result.batch.cut_at_s
            for record in expired:
                self._sink.dead_letter(
                    record,
                    pipeline.dead_letter_topic,
                    STAGE_DEADLINE,
                    "DeadlineExpired",
                    expired_reason(cut_at_s, record.deadline_s),
                    () if trace is None else trace.out(record, pipeline.dead_letter_topic),
                )
        elif expired:
            built = self._headers.expired(expired)
            if trace is not None:
                for record, more in zip(expired, built, strict=True):
                    more.extend(trace.out(record, pipeline.output_topic))
            if kept:  # merged in offset order within each partition
                rows = [
                    *zip(kept, values, headers, strict=True),
                    *zip(expired, [b""] * len(expired), built, strict=True),
                ]
                # both lists are in offset order within each partition, and offsets differ
                # within a partition: ordering by offset alone orders each partition
                rows.sort(key=_offset_of_row)
                kept = [row[0] for row in rows]
                values = [row[1] for row in rows]
                headers = [row[2] for row in rows]
            else:  # the overload's usual batch: taken in offset order within each partition
                kept, values, headers = list(expired), [b""] * len(expired), built
        if clock is not None:
            clock.lap("encode")
        settle = None
        if self._window is not None and kept:  # a wait here counts in the produce stage
            settle = self._window.hold(sum([len(r.key or b"") + len(r.value or b"") for r in kept]))
        batch = result.batch
        self._sink.send_results(
            pipeline.output_topic,
            kept,
            values,
            headers,
            pipeline.dead_letter_topic,
            clock,
            settle,
            # a batch that ran nowhere says nothing of a live batch's time to acknowledgement
            cut_at_s=batch.cut_at_s if batch.records else None,
        )
        if trace is not None and not kept:
            trace.finish()  # nothing to produce: no produce stage ends it

    def _version(self, result: DeviceResult) -> bytes:
        """The ``streamproc.model.version`` value of ``result``'s batch."""
        name = "builtin" if self._version_of is None else self._version_of(result)
        found = self._versions.get(name)
        if found is None:
            found = self._versions[name] = name.encode()
        return found

    def _encode_many(
        self,
        records: tuple[Record, ...],
        outputs: tuple[np.ndarray, ...],
        failed: dict[int, RecordError],
    ) -> list[Encoded | Exception | None]:
        """The workload's batch encode over the rows that decoded (None for the others: a row
        that failed decode, e.g. an oversized value, is never handed to the encoder).

        If the workload's ``encode_many`` raises as a whole, returns the wrong count or a value
        that is not an :class:`Encoded`, those rows count as failed tries and are encoded alone
        (with retries), so a workload bug costs speed, never the batch."""
        rows = len(records)
        if failed:
            keep = [row for row in range(rows) if row not in failed]
            records = tuple(records[row] for row in keep)
            outputs = tuple(out[keep] for out in outputs)
        try:
            encoded: list[Encoded | Exception] = list(self._workload.encode_many(records, outputs))
            if len(encoded) != len(records):
                raise ValueError(f"encode_many returned {len(encoded)} results for {len(records)}")
        except RegistryUnavailable:
            raise
        except Exception as exc:
            encoded = [exc] * len(records)
        checked: list[Encoded | Exception | None] = [
            value
            if isinstance(value, (Encoded, Exception))
            else TypeError(f"encode_many returned {type(value).__name__}, not Encoded")
            for value in encoded
        ]
        if not failed:
            return checked
        by_row: list[Encoded | Exception | None] = [None] * rows
        for row, value in zip(keep, checked, strict=True):
            by_row[row] = value
        return by_row

    def _retry_encode(
        self, record: Record, row: tuple[np.ndarray, ...], error: Exception
    ) -> Encoded:
        """The row's encode raised ``error`` in the batch call: try it alone ``attempts - 1``
        more times with exponential backoff, then re-raise the last error."""
        if self._attempts <= 1:
            raise error
        for attempt in Retrying(
            stop=stop_after_attempt(self._attempts - 1),
            wait=wait_exponential(multiplier=0.005, max=0.1),
            reraise=True,
        ):
            with attempt:
                value = self._workload.encode(record, row)
                if not isinstance(value, Encoded):
                    raise TypeError(f"encode returned {type(value).__name__}, not Encoded")
                return value
        raise AssertionError("unreachable")  # Retrying either returns or re-raises

    def _dead_letter(
        self, record: Record, dlq: str, stage: str, exc: BaseException, trace: Trace | None
    ) -> None:
        self._sink.dead_letter(
            record,
            dlq,
            stage,
            type(exc).__name__,
            str(exc),
            () if trace is None else trace.out(record, dlq),
        )


def _offset_of_row(row: tuple[Record, bytes, OutputHeaders]) -> int:
    return row[0].offset


def expired_reason(cut_at_s: float, deadline_s: float) -> str:
    """The ``streamproc.error.message`` of an expired record's dead-letter record: how late it
    was at its cut (monotonic seconds both), or, expired by prediction
    (``pipelines[].expire_when: predicted``), how soon its deadline was."""
    late_ms = (cut_at_s - deadline_s) * 1000
    if late_ms >= 0:
        return f"past its deadline by {late_ms:.1f} ms when its batch was cut; not run"
    return (
        f"due {-late_ms:.1f} ms after its batch was cut, sooner than the batch's expected "
        "acknowledgement (expire_when: predicted); not run"
    )
