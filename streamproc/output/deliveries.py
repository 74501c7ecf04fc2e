"""What a result's delivery report decides: its input is done, or the refused result is recovered.

:class:`ResultDeliveries` is the :class:`~streamproc.output.acks.DeliveryHandler` of every
batch's acknowledgement. A refused result goes first to the processing guarantee
(``Guarantee.refused``), which may keep it (the transaction aborts) or stop the pipeline; else:

* refused by the broker for its own sake in a record batch it may have shared
  (``MSG_SIZE_TOO_LARGE`` judges a whole record batch): sent again *alone*, and only a refusal of
  the record on its own dead-letters it;
* refused because the *cluster* is unavailable (:func:`~streamproc.output.producer.unavailable`):
  not the record's fault: produced again (alone) until the cluster takes it, never
  dead-lettered; its input stays pending meanwhile, so the pending limit pauses intake (under
  at-least-once results never time out by default, ``message.timeout.ms`` 0; a user's finite
  value still never dead-letters a valid result);
* refused for good: dead-lettered with stage ``produce`` and the broker's reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from attrs import define, field

from streamproc.errors import FatalPipelineError
from streamproc.kafka.protocols import DeliveryCallback
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import Guarantee
from streamproc.offsets.refusals import record_refusal
from streamproc.output.acks import RefusedResult
from streamproc.output.dead_letters import DeadLetters
from streamproc.output.latency import LatencyReport
from streamproc.output.producer import ResultsProducer, unavailable
from streamproc.records import Record
from streamproc.tracing.context import own_trace_headers

log = get_logger(__name__)


@define(eq=False)
class ResultDeliveries:
    """Recovers refused results and reports acknowledged ones to the guarantee.

    Args:
        producer: the results producer and the lone-record producer.
        dead_letters: where a result refused for good sends its input.
        guarantee: who handles a refusal first; when an input is done.
        metrics: counts produced results and their end-to-end latency.
        on_fatal: called when the pipeline must stop (the guarantee says so).
    """

    _producer: ResultsProducer
    _dead_letters: DeadLetters
    _guarantee: Guarantee
    _metrics: Metrics
    _on_fatal: Callable[[BaseException], None]
    latency: LatencyReport | None = field(init=False, default=None)
    """Where acknowledged results go as latency measurements (set before the sink starts:
    :meth:`~streamproc.output.sink.Sink.watch_latency`); None: nowhere."""

    def recover(self, refused: RefusedResult, report: DeliveryCallback) -> bool:
        """See :meth:`DeliveryHandler.recover` and the module docstring."""
        record, err, how = refused.record, refused.error, refused.how
        handling = self._guarantee.refused(record, err, how, dead_letter=False)
        if handling == "abort":
            return False
        if handling == "fatal":
            where = f"{record.tp.topic}[{record.tp.partition}]@{record.offset}"
            self._on_fatal(FatalPipelineError(f"result of {where} refused: {err.str()}"))
            return False
        if how == "batch" and record_refusal(err):
            self._producer.produce_alone(
                refused.topic, record.key, refused.value, refused.headers, report
            )
            return True
        if unavailable(err):
            self._producer.produce_again(
                refused.topic, record, refused.value, refused.headers, err, report
            )
            return True
        log.warning(
            "result rejected",
            **record.where(),
            error=str(err),
        )
        self._dead_letters.send(
            record,
            refused.dead_letter_topic,
            "produce",
            f"KafkaError.{err.name()}",
            err.str(),
            own_trace_headers(refused.headers),
        )
        return False

    def acknowledged(
        self,
        topic: str,
        records: Sequence[Record],
        exemplar: dict[str, str] | None = None,
        cut_s: float | None = None,
    ) -> None:
        """Count the batch's acknowledged results and their end-to-end latency (input
        timestamp to now; ``exemplar``: the batch's sampled trace id), measure their lane's
        latency target (consume to now; ``cut_s``: the batch's cut, monotonic seconds), and
        tell the guarantee its inputs are done."""
        if not records:
            return
        self._metrics.child(self._metrics.produced, topic).inc(len(records))
        created_ms = np.fromiter((r.timestamp_ms for r in records), np.float64, len(records))
        self._metrics.end_to_end.labels(records[0].tp.topic).observe_many(
            np.maximum(0.0, (time.time() * 1000.0 - created_ms) / 1000.0), exemplar
        )
        if self.latency is not None:
            self.latency.acknowledged(records, cut_s)
        self._guarantee.acknowledged(records)
