"""Assembly: builds every stage of the process from the config, one function per stage.
Nothing is started here; :class:`~streamproc.pipeline.Pipeline` owns the lifecycle.

Words (one word, one thing):

* *pipeline*: one ``pipelines[]`` entry, an input topic bound to a workload and an output topic;
  the class :class:`~streamproc.pipeline.Pipeline` is the process that hosts all of them.
* *lane*: a :class:`~streamproc.intake.lane.Lane`, one pipeline's rings and batch-cut policy
  under one lock. There is one per pipeline, so "per lane" counts the same as "per pipeline".
* :class:`TopicStages`: everything built for one pipeline, keyed by its input topic
  (:mod:`.topic`).
* :class:`Shared`: what every pipeline shares, one of each per process (:mod:`.shared`);
  its decode workers are a strategy chosen once from ``worker.decode_mode`` (:mod:`.decoding`).

Build order (each step needs the ones before it)::

    metrics, offset tracker -> devices -> decode workers -> results producer, guarantee, sink
      -> device admission -> per pipeline: workload, staging pool, decoder, lane, placement
         state, the serving model version (``pipelines[].model``), result handler and
         resequencer, one device worker per device (models built and their precision checked
         here)
      -> source (over the lanes) -> dispatchers (they hand resume decisions to the source)
      -> lag monitor -> health endpoint
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Mapping
from dataclasses import dataclass

from confluent_kafka import Consumer, ShareConsumer

from streamproc.assembly.decoding import build_decoding
from streamproc.assembly.shared import (
    OnFatal,
    Shared,
    admin_settings,
    build_output,
    late_results_reporter,
)
from streamproc.assembly.topic import TopicStages, build_dispatcher, build_topic_stages
from streamproc.config import Config
from streamproc.device import DeviceWorker
from streamproc.dispatch.admission import DeviceAdmission
from streamproc.dispatch.dispatcher import Dispatcher
from streamproc.dispatch.selection import select_devices
from streamproc.errors import ConfigError
from streamproc.health import HealthServer, Probe
from streamproc.intake.lane import Lane
from streamproc.intake.source import Source
from streamproc.kafka.lag import LagMonitor
from streamproc.kafka.protocols import ConsumerFactory, ProducerFactory
from streamproc.logs import get_logger
from streamproc.metrics import Metrics
from streamproc.models.admin import AdminApi
from streamproc.models.manager import ModelManager
from streamproc.offsets.guarantees import ShareAcknowledgements
from streamproc.offsets.tracker import OffsetTracker
from streamproc.output.headers import STAGE_DELIVERY
from streamproc.records import Record
from streamproc.schemas.writers import WriterSchemas
from streamproc.share.source import ShareSource
from streamproc.tracing.export import Tracing

log = get_logger(__name__)

__all__ = ["Intake", "Shared", "Stages", "TopicStages", "admin_settings", "assemble"]

Intake = Source | ShareSource
"""The thread that owns the consumer: a consumer group's or a share group's
(``kafka.group_type``); the same surface for the pipeline and the lag monitor."""


@dataclass(frozen=True)
class Stages:
    """Every stage of the process, built and not started."""

    shared: Shared
    topics: tuple[TopicStages, ...]
    """One per pipeline, in config order."""
    source: Intake
    dispatchers: tuple[Dispatcher, ...]
    """One per pipeline, in config order."""
    lag: LagMonitor
    http: HealthServer | None
    """None with ``metrics.port: 0``."""

    @property
    def managers(self) -> list[ModelManager]:
        """The model thread of every versioned pipeline."""
        return [stages.model.manager for stages in self.topics if stages.model is not None]

    @property
    def workers(self) -> list[DeviceWorker]:
        """Every device worker, by pipeline, then device."""
        return [worker for stages in self.topics for worker in stages.workers]


def assemble(
    config: Config,
    on_fatal: OnFatal,
    live: Probe,
    ready: Probe,
    consumer_factory: ConsumerFactory | None,
    producer_factory: ProducerFactory,
) -> Stages:
    """Build every stage from ``config``, in the order of the module docstring.

    Args:
        on_fatal: what a stage calls when the process must stop (any thread).
        live, ready: the ``/healthz`` and ``/readyz`` probes.
        consumer_factory, producer_factory: build the Kafka clients (tests pass fakes; None:
            ``confluent_kafka.Consumer``, or ``ShareConsumer`` for a share group).

    Raises:
        ConfigError: librdkafka refused a setting under ``kafka.consumer``/``kafka.producer``,
            a device is not visible, or a model refused its precision.
    """
    metrics = Metrics()
    share = config.kafka.group_type == "share"
    tracker = OffsetTracker(on_late=late_results_reporter(metrics, share))
    registry = config.schema_registry
    settings = registry.client_settings() if config.schema_managed else None
    backoff_s = (registry.retry_backoff_s, registry.retry_backoff_max_s)
    with contextlib.ExitStack() as release:
        # A stage that fails to build: what was built before it is given back, newest first
        # (nothing else would close it: the writer schemas' HTTP session, the decode pool, the
        # producer and the transactional id's host slot, which a start tried again in this
        # process would otherwise not get, the staging slabs, the consumer). On success the
        # pipeline owns them all.
        decoding = build_decoding(config.worker, metrics, settings, backoff_s)
        release.callback(decoding.close)
        guarantee, sink = build_output(config, tracker, metrics, on_fatal, producer_factory)
        release.callback(sink.close, 0.0)
        devices = select_devices(config.worker.device, config.worker.devices)
        worker = config.worker
        admission = DeviceAdmission.if_needed(
            worker.priority_admission, len(config.pipelines), worker.priority_max_defer_ms / 1e3
        )
        schemas = None if settings is None else WriterSchemas.probed(settings, *backoff_s)
        if schemas is not None:
            release.callback(schemas.close)
        tracing = Tracing(config.tracing, metrics) if config.tracing.active else None
        if tracing is not None:
            release.callback(tracing.shutdown)
        log.info(
            "tracing",
            on=tracing is not None,
            endpoint=config.tracing.endpoint if tracing is not None else None,
            sample_ratio=config.tracing.sample_ratio,
        )
        shared = Shared(
            config,
            metrics,
            tracker,
            devices,
            decoding,
            guarantee,
            sink,
            admission,
            on_fatal,
            schemas,
            tracing=tracing,
        )
        topics = tuple(
            _given_back_on_failure(build_topic_stages(spec, shared), release)
            for spec in config.pipelines
        )
        lanes = {stages.topic: stages.lane for stages in topics}
        sink.watch_latency(lanes)
        source = build_source(shared, lanes, consumer_factory)
        release.callback(source.close, 0.0)
        dispatchers = tuple(build_dispatcher(stages, source.apply, shared) for stages in topics)
        lag = build_lag_monitor(config, source, tracker, metrics, topics)
        managers = {
            spec.name: stages.model.manager
            for spec, stages in zip(config.pipelines, topics, strict=True)
            if stages.model is not None
        }
        http = build_health(config, metrics, live, ready, managers)
        release.pop_all()
    return Stages(shared, topics, source, dispatchers, lag, http)


def _given_back_on_failure(stages: TopicStages, release: contextlib.ExitStack) -> TopicStages:
    """``stages``, its staging slabs registered with ``release`` (closed if a later stage
    fails to build)."""
    release.callback(stages.staging.close)
    return stages


def build_source(
    shared: Shared, lanes: Mapping[str, Lane], consumer_factory: ConsumerFactory | None
) -> Intake:
    """The source thread over ``lanes``: a consumer group's (:class:`Source`) or a share
    group's (:class:`ShareSource`), by ``kafka.group_type``.

    Raises:
        ConfigError: librdkafka refused a setting under ``kafka.consumer``.
    """
    config, guarantee = shared.config, shared.guarantee
    args = (config, lanes, shared.tracker)
    if isinstance(guarantee, ShareAcknowledgements):
        dlq_topics = {spec.input_topic: spec.dead_letter_topic for spec in config.pipelines}
        sink, tracing = shared.sink, shared.tracing

        def dead_letter(record: Record, error_class: str, message: str) -> None:
            topic = dlq_topics[record.tp.topic]
            trace = () if tracing is None else tracing.out_of(record, topic)
            sink.dead_letter(record, topic, STAGE_DELIVERY, error_class, message, trace)

        return ShareSource(
            *args,
            guarantee,
            shared.metrics,
            shared.on_fatal,
            consumer_factory or ShareConsumer,
            control=shared.control,
            dead_letter=dead_letter,
        )
    return Source(
        *args,
        guarantee,
        shared.metrics,
        shared.on_fatal,
        consumer_factory or Consumer,
        control=shared.control,
    )


def build_lag_monitor(
    config: Config,
    source: Intake,
    tracker: OffsetTracker,
    metrics: Metrics,
    topics: tuple[TopicStages, ...],
) -> LagMonitor:
    """The ``lag`` thread; every ``metrics.lag_interval_s`` it also samples the GPU gauges and
    checks every pipeline's devices for stalls; for a share group it also measures the end
    offset of every input partition (a share member has no position of its own)."""

    def tick() -> None:
        metrics.sample_gpu()
        for stages in topics:
            stages.load.check_stalls()

    lag = LagMonitor(
        admin_settings(config),
        config.kafka.group_id,
        source.positions,
        metrics,
        config.metrics.lag_interval_s,
        on_tick=tick,
        stall_timeout_s=config.metrics.stall_timeout_s,
        backlog=tracker.backlog,
    )
    if config.kafka.group_type == "share":
        lag.watch_ends([p.input_topic for p in config.pipelines])
    return lag


METRICS_PORTS_TRIED = 16
"""Ports tried from the default ``metrics.port`` on: processes started from one config on one
host (the default port not set by hand) each take the next free one instead of failing."""


def build_health(
    config: Config,
    metrics: Metrics,
    live: Probe,
    ready: Probe,
    managers: Mapping[str, ModelManager],
) -> HealthServer | None:
    """``/metrics``, ``/healthz``, ``/readyz`` and the model admin routes (``GET /models``,
    ``POST /models/<pipeline>``) on ``metrics.port`` (None: ``port: 0``).

    A ``metrics.port`` left at its default that another process of the host holds (several
    ``streamproc run`` from one config) is passed over for the next free one of
    :data:`METRICS_PORTS_TRIED` (a warning names the port taken); one set by hand is not.

    Raises:
        ConfigError: the port set by hand is in use, or every port tried is.
    """
    settings = config.metrics
    if not settings.port:
        return None
    admin = AdminApi(config.admin.token, managers)
    chosen = "port" in settings.model_fields_set
    ports = [settings.port] if chosen else range(settings.port, settings.port + METRICS_PORTS_TRIED)
    for port in ports:
        try:
            server = HealthServer(settings.host, port, metrics.registry, live, ready, admin)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics.port: cannot serve on {settings.host}:{port}: {exc}"
                ) from exc
            continue
        if port != settings.port:
            log.warning(
                "metrics port in use: serving metrics, probes and the admin routes on the next "
                "free one (set metrics.port per process to choose)",
                default=settings.port,
                port=port,
            )
        return server
    tried = f"{settings.port}" if chosen else f"{settings.port}-{ports[-1]}"
    raise ConfigError(
        f"metrics.port: {settings.host}:{tried} in use by another process; set metrics.port "
        "to a free port (STREAMPROC_METRICS__PORT), or 0 to serve no metrics endpoint"
    )
