"""The stages every pipeline of the process shares (one of each per process), and their
builders: the offset tracker's late-results hook, the results producer with the processing
guarantee and the sink, the device admission, the Schema Registry's writer schemas, and the
settings the admin clients connect with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamproc.assembly.decoding import Decoding
from streamproc.config import Config
from streamproc.config.sections import Scalar
from streamproc.dispatch.admission import DeviceAdmission
from streamproc.dispatch.selection import DeviceSpec
from streamproc.intake.source_control import SourceControl
from streamproc.kafka.protocols import ProducerFactory
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.offsets.guarantees import (
    AtLeastOnce,
    ExactlyOnce,
    Guarantee,
    ShareAcknowledgements,
)
from streamproc.offsets.identity import claim_transactional_id
from streamproc.offsets.tracker import LateHook, OffsetTracker
from streamproc.offsets.transactions import Transactions
from streamproc.output.producer import ResultsProducer, build_producer, producer_settings
from streamproc.output.sink import Sink
from streamproc.records import TopicPartition
from streamproc.schemas.writers import WriterSchemas
from streamproc.stages import StageRecorder
from streamproc.tracing.batch import BatchTracer
from streamproc.tracing.export import Tracing

log = get_logger(__name__)

OnFatal = Callable[[BaseException], None]
"""Called by any stage, from any thread, when the process must stop."""


@dataclass(frozen=True)
class Shared:
    """The stages every pipeline shares, with the config and the fatal-error hook."""

    config: Config
    metrics: Metrics
    tracker: OffsetTracker
    devices: tuple[DeviceSpec, ...]
    decoding: Decoding
    guarantee: Guarantee
    sink: Sink
    admission: DeviceAdmission | None
    on_fatal: OnFatal
    schemas: WriterSchemas | None = None  # the Schema Registry's writer schemas, when one is set
    control: SourceControl = field(default_factory=SourceControl)
    """The source thread's control queue (a version switch asks it for a commit)."""
    tracing: Tracing | None = None
    """The tracer and its export (None: tracing off)."""

    def stage_recorder(self, topic: str) -> StageRecorder:
        """The stage histograms of input ``topic``, with a batch tracer when tracing is on."""
        tracer = None
        if self.tracing is not None:
            metrics = self.metrics
            tracer = BatchTracer(
                self.tracing.tracer,
                topic,
                self.config.kafka.group_id,
                self.config.tracing.max_links,
                metrics.trace_context_invalid.labels(topic),
                metrics.trace_links_dropped.labels(topic),
            )
        return StageRecorder(self.metrics.stage, topic, tracer=tracer)


def late_results_reporter(metrics: Metrics, share: bool = False) -> LateHook:
    """The offset tracker's ``on_late``: results for a partition no longer owned (revoked while
    in flight; ``share``: records released to the share group while in flight) are produced
    (duplicates under at-least-once), never committed nor acknowledged; each is counted in
    ``streamproc_late_results_total`` and the first of an assignment (a share poll) is
    logged."""
    event = (
        "late results for records released to the share group; produced, not acknowledged "
        "(the group delivers them again)"
        if share
        else "late results for a partition no longer owned; produced, not committed"
    )

    def report(tp: TopicPartition, count: int, first: bool) -> None:
        metrics.late_results.inc(count)
        if first:
            log.warning(
                f"{event} (further ones are counted in streamproc_late_results_total)",
                topic=tp.topic,
                partition=tp.partition,
                results=count,
            )

    return report


def build_output(
    config: Config,
    tracker: OffsetTracker,
    metrics: Metrics,
    on_fatal: OnFatal,
    producer_factory: ProducerFactory,
) -> tuple[Guarantee, Sink]:
    """The results producer, the processing guarantee (chosen once: the source and the sink
    never branch on it) and the sink, which owns the producer from then on.

    Under exactly-once the ``transactional.id`` is chosen here
    (:func:`~streamproc.offsets.identity.claim_transactional_id`); the sink holds it, and
    gives its host slot back when it closes.

    Raises:
        ConfigError: librdkafka refused a setting under ``kafka.producer``, or no
            transactional id slot could be taken.
    """
    identity = claim_transactional_id(config) if config.exactly_once else None
    settings = producer_settings(
        {"bootstrap.servers": config.bootstrap_servers, **config.kafka.producer},
        None if identity is None else identity.transactional_id,
    )
    try:
        client = build_producer(settings, producer_factory)
    except BaseException:
        if identity is not None:
            identity.release()
        raise
    producer = ResultsProducer(client, settings, metrics, on_fatal, producer_factory)
    guarantee: Guarantee = (
        ExactlyOnce(
            tracker,
            metrics,
            Transactions(client, renew=producer.renew),
            max_aborts=config.kafka.max_transaction_aborts,
        )
        if config.exactly_once
        else ShareAcknowledgements(tracker, metrics)
        if config.kafka.group_type == "share"
        else AtLeastOnce(tracker, metrics)
    )
    return guarantee, Sink(producer, guarantee, metrics, on_fatal, identity=identity)


def admin_settings(config: Config) -> dict[str, Scalar]:
    """What the admin clients and the lag monitor's probe consumer connect with: the brokers
    and the ``security.*``, ``sasl.*``, ``ssl.*`` and ``client.*`` settings of
    ``kafka.consumer``."""
    security = {
        key: value
        for key, value in config.kafka.consumer.items()
        if key.startswith(("security.", "sasl.", "ssl.", "client."))
    }
    return {"bootstrap.servers": config.bootstrap_servers, **security}
